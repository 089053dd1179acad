"""The Responses API (`POST /v1/responses`) as vLLM serves it, over the chat path: a request becomes the chat
request it means (`instructions` a system message first, `input` a string or a list of message,
`function_call` and `function_call_output` items, tools flattened into chat's `function` shape), rendered by the
model's chat template and decoded as a chat completion is; the answer becomes output items (a `message` with
`output_text`, one `function_call` per tool call) and, streamed, the Responses events (`response.created`,
`response.output_text.delta`, ..., `response.completed`).

Nothing is stored: `store: true`, `previous_response_id` and `conversation` are refused by name, as is every
other field this server would have to ignore (hosted tools, `include`, reasoning). `text.format` json_schema and
json_object constrain the output as chat's `response_format` does."""

from __future__ import annotations

import json
import time
from typing import Any, Literal, Optional, Union

from pydantic import Field, ValidationError

from coordinator.serve.protocol import ChatCompletionRequest, OpenAIModel, ToolCall, random_id
from coordinator.serve.limits import SEED_MAX, SEED_MIN
from coordinator.serve.tools import ToolCallStream


class ResponsesError(ValueError):
    """A Responses request this server cannot serve as asked (HTTP 400); `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class ResponsesRequest(OpenAIModel):
    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=0)
    temperature: Optional[float] = Field(default=None, ge=0, le=2)
    top_p: Optional[float] = Field(default=None, gt=0, le=1)
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None  # every call the model writes is returned
    stream: bool = False
    metadata: Optional[dict[str, str]] = None  # returned as given
    user: Optional[str] = None
    # vLLM's sampling extensions, as on chat
    top_k: Optional[int] = None
    seed: Optional[int] = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: Optional[Union[str, list[str]]] = None
    repetition_penalty: Optional[float] = Field(default=None, gt=0, le=100)
    ignore_eos: bool = False
    cache_salt: Optional[str] = Field(default=None, min_length=1, max_length=1024)  # as on chat
    # known, accepted only at their defaults (refusal() says why)
    store: Optional[bool] = None
    previous_response_id: Optional[str] = None
    conversation: Optional[Any] = None
    background: Optional[bool] = None
    include: Optional[list[str]] = None
    text: Optional[dict[str, Any]] = None
    reasoning: Optional[dict[str, Any]] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    top_logprobs: Optional[int] = None
    max_tool_calls: Optional[int] = None

    def refusal(self) -> Optional[ResponsesError]:
        """The first field set to something this server does not do, as the error to answer; None if all fit."""
        stored = "this server stores no responses"
        if self.store:
            return ResponsesError("store", f"'store': true is not supported: {stored}; send 'store': false or "
                                           f"leave it out")
        if self.previous_response_id is not None:
            return ResponsesError("previous_response_id", f"'previous_response_id' is not supported: {stored}; "
                                                          f"send the earlier turns in 'input'")
        if self.conversation is not None:
            return ResponsesError("conversation", f"'conversation' is not supported: {stored}; send the earlier "
                                                  f"turns in 'input'")
        if self.background:
            return ResponsesError("background", "'background': true is not supported by this server")
        if self.include:
            return ResponsesError("include", f"'include' is not supported by this server (value {self.include!r})")
        if self.reasoning and any(value is not None for value in self.reasoning.values()):
            return ResponsesError("reasoning", f"'reasoning' is not supported by this server "
                                              f"(value {self.reasoning!r})")
        if self.truncation == "auto":
            return ResponsesError("truncation", "'truncation': \"auto\" is not supported: a prompt longer than the "
                                                "context is refused, never cut")
        if self.top_logprobs:
            return ResponsesError("top_logprobs", "'top_logprobs' is not supported by /v1/responses on this server; "
                                                  "/v1/chat/completions returns logprobs")
        if self.max_tool_calls is not None:
            return ResponsesError("max_tool_calls", "'max_tool_calls' is not supported by this server")
        for key, value in (self.text or {}).items():
            if key == "format":
                if value is not None and (not isinstance(value, dict) or value.get("type") not in FORMATS):
                    kind = value.get("type") if isinstance(value, dict) else value
                    return ResponsesError("text.format", f"'text.format' of type {kind!r} is not supported "
                                                         f"({', '.join(FORMATS)})")
            elif value is not None:
                return ResponsesError(f"text.{key}", f"'text.{key}' is not supported by this server")
        return None

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion this request asks for; ResponsesError naming the first item it cannot be."""
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions is not None else [])
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            for index, item in enumerate(self.input):
                _add_item(messages, item, f"input[{index}]")
        fields = dict(messages=messages, max_tokens=self.max_output_tokens, temperature=self.temperature,
                      top_p=self.top_p, top_k=self.top_k, seed=self.seed, stop=self.stop,
                      repetition_penalty=self.repetition_penalty, ignore_eos=self.ignore_eos, stream=self.stream,
                      cache_salt=self.cache_salt,
                      parallel_tool_calls=self.parallel_tool_calls, tool_choice=_chat_tool_choice(self.tool_choice))
        if self.tools is not None:
            fields["tools"] = [_chat_tool(tool, f"tools[{index}]") for index, tool in enumerate(self.tools)]
        fields["response_format"] = _chat_response_format((self.text or {}).get("format"))
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as error:
            problem = error.errors()[0]
            where = ".".join(str(part) for part in problem["loc"])
            raise ResponsesError("input", f"the input does not form a chat: {where}: {problem['msg']}") from None


# ---- input items -> chat messages -------------------------------------------------------------------------------

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
FORMATS = ("text", "json_object", "json_schema")  # text.format types (the JSON ones constrain the output)
TEXT_PARTS = ("input_text", "output_text")


def _only(item: dict, where: str, allowed: tuple[str, ...]) -> None:
    for key, value in item.items():
        if key not in allowed and value is not None:
            raise ResponsesError(f"{where}.{key}", f"'{where}.{key}' is not supported by this server")


def _text(content: Any, where: str) -> str:
    """A string, or a list of input_text / output_text parts, as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ResponsesError(where, f"'{where}' must be a string or a list of text parts")
    parts = []
    for index, part in enumerate(content):
        at = f"{where}[{index}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise ResponsesError(f"{at}.type", f"'{at}.type' {kind!r} is not supported by this server (text "
                                               f"only: {', '.join(TEXT_PARTS)})")
        _only(part, at, ("type", "text", "annotations", "logprobs"))
        if not isinstance(part.get("text"), str):
            raise ResponsesError(f"{at}.text", f"'{at}.text' must be a string")
        parts.append(part["text"])
    return "".join(parts)


def _add_item(messages: list[dict], item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise ResponsesError(where, f"'{where}' must be an object")
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        _only(item, where, ("type", "role", "content", "id", "status"))
        role = item.get("role")
        if role not in MESSAGE_ROLES:
            raise ResponsesError(f"{where}.role", f"'{where}.role' {role!r} is not one of "
                                                  f"{', '.join(MESSAGE_ROLES)}")
        messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
    elif kind == "function_call":
        _only(item, where, ("type", "call_id", "name", "arguments", "id", "status"))
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise ResponsesError(f"{where}.{key}", f"'{where}.{key}' must be a string")
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":  # the calls of one turn go on its one message
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        _only(item, where, ("type", "call_id", "output", "id", "status"))
        if not isinstance(item.get("call_id"), str):
            raise ResponsesError(f"{where}.call_id", f"'{where}.call_id' must be a string")
        messages.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": _text(item.get("output"), f"{where}.output")})
    else:
        raise ResponsesError(f"{where}.type", f"'{where}.type' {kind!r} is not supported by this server "
                                              f"(message, function_call, function_call_output)")


def _chat_tool(tool: Any, where: str) -> dict:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise ResponsesError(f"{where}.type", f"'{where}.type' {kind!r} is not supported by this server "
                                              f"(function tools only)")
    _only(tool, where, ("type", "name", "description", "parameters", "strict"))
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None}
    return {"type": "function", "function": function}


def _chat_response_format(format: Optional[dict]) -> Optional[dict]:
    """`text.format` as chat's `response_format`: the Responses API writes a json_schema's name, schema and strict
    beside its type."""
    if format is None or format.get("type") != "json_schema":
        return format
    return {"type": "json_schema", "json_schema": {key: format.get(key) for key in ("name", "schema", "strict")}}


def _chat_tool_choice(choice: Any) -> Any:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function":
        raise ResponsesError("tool_choice", f"'tool_choice' of type {choice.get('type')!r} is not supported by "
                                            f"this server")
    return {"type": "function", "function": {"name": choice.get("name")}}


# ---- the answer -> output items, a response, events ------------------------------------------------------------

def message_item(text: str, status: str = "completed", ident: Optional[str] = None) -> dict:
    return {"type": "message", "id": ident or random_id("msg"), "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status ==
            "completed" else []}


def call_item(call: ToolCall, status: str = "completed") -> dict:
    return {"type": "function_call", "id": random_id("fc"), "call_id": call.id, "name": call.function.name,
            "arguments": call.function.arguments if status == "completed" else "", "status": status}


def output_items(content: Optional[str], calls: list[ToolCall]) -> list[dict]:
    """A finished answer's items: its text (when there is any, or when there is nothing else), then its calls."""
    items = [message_item(content)] if content or not calls else []
    return items + [call_item(call) for call in calls]


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


class ResponseShape:
    """The response object of one request, as it stands: what the request asked (echoed) and what came out."""

    def __init__(self, request: ResponsesRequest, model: str) -> None:
        self.request = request
        self.model = model
        self.id = random_id("resp")
        self.created_at = int(time.time())

    def body(self, status: str, output: list[dict], usage_info: Optional[dict] = None,
             finish_reason: Optional[str] = None) -> dict:
        request = self.request
        incomplete = status == "incomplete"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
            "status": status, "output": output, "usage": usage_info, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "metadata": request.metadata, "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": None, "store": False, "background": False,
            "temperature": request.temperature, "top_p": request.top_p,
            "text": {"format": (request.text or {}).get("format") or {"type": "text"}},
            "tool_choice": request.tool_choice or "auto",
            "tools": request.tools or [], "truncation": request.truncation or "disabled", "user": request.user,
        }

    @staticmethod
    def status_of(finish_reason: Optional[str]) -> str:
        return "incomplete" if finish_reason == "length" else "completed"


class ResponseEvents:
    """Streamed text -> the Responses events, numbered: a message item opened at its first text, its
    `output_text.delta` events, and closed when a tool call or the end comes; each call a `function_call` item
    with its arguments in one delta (the chat stream's calls are whole too)."""

    def __init__(self, shape: ResponseShape, parse_tools: bool) -> None:
        self.shape = shape
        self.parser = ToolCallStream() if parse_tools else None
        self.output: list[dict] = []  # finished items
        self.message: Optional[dict] = None  # the open message item
        self.text = ""  # its text so far
        self.sequence = 0

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def start(self) -> list[str]:
        opened = self.shape.body("in_progress", [])
        return [self.event("response.created", response=opened), self.event("response.in_progress", response=opened)]

    def feed(self, text: str, final: bool) -> list[str]:
        if self.parser is None:
            pieces: list = [text]
        else:
            pieces = self.parser.feed(text) + (self.parser.finish() if final else [])
        out: list[str] = []
        for piece in pieces:
            if isinstance(piece, str):
                out += self._text(piece) if piece else []
            else:
                out += self._close_message() + self._call(piece)
        return out

    def finish(self, prompt_tokens: int, output_tokens: int, finish_reason: Optional[str],
               cached_tokens: int = 0) -> list[str]:
        out = []
        if self.message is None and not self.output:
            out += self._open_message()  # an empty answer is an empty message, as a non-streamed one
        out += self._close_message()
        status = self.shape.status_of(finish_reason)
        body = self.shape.body(status, self.output, usage(prompt_tokens, output_tokens, cached_tokens))
        return out + [self.event(f"response.{status}", response=body)]

    def failed(self, message: str) -> list[str]:
        return [self.event("error", code="server_error", message=message, param=None)]

    def _open_message(self) -> list[str]:
        self.message, self.text = message_item("", status="in_progress"), ""
        where = dict(item_id=self.message["id"], output_index=len(self.output), content_index=0)
        return [self.event("response.output_item.added", output_index=len(self.output), item=self.message),
                self.event("response.content_part.added", **where, part=_part(""))]

    def _text(self, text: str) -> list[str]:
        out = self._open_message() if self.message is None else []
        self.text += text
        return out + [self.event("response.output_text.delta", item_id=self.message["id"],
                                 output_index=len(self.output), content_index=0, delta=text, logprobs=[])]

    def _close_message(self) -> list[str]:
        if self.message is None:
            return []
        done = message_item(self.text, ident=self.message["id"])
        where = dict(item_id=done["id"], output_index=len(self.output), content_index=0)
        out = [self.event("response.output_text.done", **where, text=self.text, logprobs=[]),
               self.event("response.content_part.done", **where, part=_part(self.text)),
               self.event("response.output_item.done", output_index=len(self.output), item=done)]
        self.output.append(done)
        self.message = None
        return out

    def _call(self, call: ToolCall) -> list[str]:
        done = call_item(call)
        opened = {**done, "arguments": "", "status": "in_progress"}
        where = dict(item_id=done["id"], output_index=len(self.output))
        out = [self.event("response.output_item.added", output_index=len(self.output), item=opened),
               self.event("response.function_call_arguments.delta", **where, delta=done["arguments"]),
               self.event("response.function_call_arguments.done", **where, name=done["name"],
                          arguments=done["arguments"]),
               self.event("response.output_item.done", output_index=len(self.output), item=done)]
        self.output.append(done)
        return out


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
