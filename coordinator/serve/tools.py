"""Tool calling in Qwen's (Hermes) format: tools reach the model through its chat template (the template's
`tools` variable), and the model answers a call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

which becomes an OpenAI `tool_calls` entry (`arguments` as a JSON string), as vLLM's `hermes` parser does.
Text before the first `<tool_call>` stays the message content.

`tool_choice`: "none" renders the tools and parses nothing; "auto" (the default with tools) renders and
parses. "required" and a named function render, parse, and constrain the output to a call (of that function) with
arguments valid for its parameters (`tool_call_grammar`; coordinator.guided builds the grammar)."""

from __future__ import annotations

import json
import re
from typing import Any, Optional, Union

from coordinator.guided import GrammarError, GrammarSpec
from coordinator.serve.protocol import ChatMessage, FunctionCall, ToolCall

START, END = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(START) + r"(.*?)" + re.escape(END), re.DOTALL)


class ToolError(ValueError):
    """A tools request this server cannot serve as asked (HTTP 400)."""


def check_tool_choice(tools, tool_choice) -> bool:
    """Whether the output is parsed for tool calls; ToolError for what cannot be honoured."""
    if tool_choice is None:
        return bool(tools)
    if isinstance(tool_choice, dict):
        tool_call_grammar(tools, tool_choice, parallel=False)  # names a function among the tools
        return True
    if tool_choice in ("auto", "required") and not tools:
        raise ToolError(f"tool_choice \"{tool_choice}\" needs tools")
    return tool_choice in ("auto", "required")


def tool_call_grammar(tools, tool_choice, parallel: bool):
    """The grammar (`coordinator.guided.GrammarSpec`) a "required" or named `tool_choice` constrains the output to;
    None for "auto" and "none". ToolError for a choice that names no function among the tools."""
    if tool_choice not in ("required",) and not isinstance(tool_choice, dict):
        return None
    name = None
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise ToolError(f"tool_choice must be \"none\", \"auto\", \"required\" or "
                            f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {tool_choice!r}")
    functions = [{"name": tool.function.name, "parameters": tool.function.parameters} for tool in tools or ()]
    try:  # a named function is called once (as vLLM's named tool_choice); "required" may call several
        return GrammarSpec.tool_calls(functions, name, parallel and name is None)
    except GrammarError as error:
        raise ToolError(str(error)) from None


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates read them: an assistant's tool calls with `arguments` parsed into a dict
    (as vLLM hands them to templates, which write them with `tojson`), a tool message's `tool_call_id`."""
    out = []
    for message in messages:
        entry: dict[str, Any] = {"role": message.role, "content": message.text()}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            calls = []
            for call in message.tool_calls:
                try:
                    arguments = json.loads(call.function.arguments)
                except json.JSONDecodeError:
                    raise ToolError(f"the arguments of tool call {call.id!r} are not JSON: "
                                    f"{call.function.arguments[:200]!r}") from None
                except RecursionError:
                    raise ToolError(f"the arguments of tool call {call.id!r} nest deeper than this server "
                                    f"parses") from None
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": arguments}})
            entry["tool_calls"] = calls
        out.append(entry)
    return out


def _call(body: str) -> Optional[ToolCall]:
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, RecursionError):  # too deep to parse is not a call: it stays text
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return ToolCall(function=FunctionCall(name=value["name"], arguments=json.dumps(arguments, ensure_ascii=False)))


def parse_tool_calls(text: str) -> tuple[Optional[str], list[ToolCall]]:
    """(content, tool calls) of a finished answer; no well-formed call: the whole text is content."""
    if START not in text:
        return text, []
    calls = [_call(body) for body in _CALL.findall(text)]
    if not calls or any(call is None for call in calls):
        return text, []
    content = text[:text.find(START)]
    return (content if content.strip() else None), calls


class ToolCallStream:
    """Streamed text -> content deltas and complete tool calls. Text that may be the start of `<tool_call>` is
    held back; a call is sent whole (name and arguments in one delta) once its `</tool_call>` arrives."""

    def __init__(self) -> None:
        self.buffer = ""
        self.scanned = 0  # inside a call: how much of the buffer is known to hold no `</tool_call>`
        self.in_call = False
        self.calls = 0  # calls parsed
        self.calls_sent = 0  # calls sent as stream deltas: the next call's `index`

    def feed(self, text: str) -> list[Union[str, ToolCall]]:
        self.buffer += text
        events: list[Union[str, ToolCall]] = []
        while True:
            if not self.in_call:
                at = self.buffer.find(START)
                if at < 0:
                    keep = _partial_suffix(self.buffer, START)
                    ready, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                    if ready:
                        events.append(ready)
                    return events
                if at > 0 and self.buffer[:at].strip():
                    events.append(self.buffer[:at])
                self.buffer, self.in_call, self.scanned = self.buffer[at + len(START):], True, 0
            # only the new text (and an END that may straddle it) is searched: linear in the call's length
            end = self.buffer.find(END, max(0, self.scanned - len(END) + 1))
            if end < 0:
                self.scanned = len(self.buffer)
                return events
            call = _call(self.buffer[:end])
            events.append(call if call is not None else START + self.buffer[:end] + END)
            self.calls += call is not None
            self.buffer, self.in_call = self.buffer[end + len(END):].lstrip("\n"), False

    def finish(self) -> list[Union[str, ToolCall]]:
        """What is left at the end: an unterminated call is parsed if it is whole JSON, else returned as text."""
        rest, self.buffer = self.buffer, ""
        if self.in_call:
            call = _call(rest)
            if call is not None:
                self.calls += 1
                return [call]
            return [START + rest]
        return [rest] if rest and (rest.strip() or not self.calls) else []


def _partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `token`."""
    for size in range(min(len(token) - 1, len(text)), 0, -1):
        if text.endswith(token[:size]):
            return size
    return 0
