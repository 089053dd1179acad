"""Constrained (guided) decoding: a grammar compiled by xgrammar, one matcher per sequence on the coordinator, and
the per-row token masks the head shard applies (PROTOCOL.md, "Token masks").

What a request may ask for (`GrammarSpec`): a JSON schema (`response_format` json_schema, `text.format`), any JSON
object (`json_object`), or a tool call (`tool_choice` "required" or a named function). The tool-call grammar is
built as vLLM builds its own for these choices, from the JSON schema of a call, here wrapped in Qwen's tool-call
tags so the output is what `coordinator.serve.tools` parses:

    <tool_call>\\n{"name": "<one of the tools>", "arguments": <that tool's parameters schema>}\\n</tool_call>

(a union over the tools, one per allowed name; each newline optional; with parallel tool calls, more calls may
follow, each after a newline). It is composed of xgrammar's own grammars (`Grammar.from_json_schema`, `concat`,
`union`) rather than structural tags, so the text outside the JSON is fixed and nothing in the tags depends on the
model's vocabulary.
JSON is compact (no whitespace between tokens beyond `separators`): output stays bounded, as vLLM's
`disable-any-whitespace`.

Speculation keeps the constrained distribution exactly (`Guide.plan`): the matcher walks the drafts, each answered
row of the verify gets the mask of the state before it, and the walk is rolled back; a draft the grammar forbids (or
one that would complete it) ends the drafts before it, since the target would reject it anyway. Commits advance the
matcher (`Guide.commit`); once the grammar is complete (only a stop token may follow) or a stop token ended it, the
stream stops ("stop"), as vLLM ends a finished grammar with EOS. xgrammar is imported only when a request asks for
a grammar, so the daemons and plain serving never load it."""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

from protocol import WireTensor

# Compiled grammars kept per (grammar, tokenizer): compiling a schema takes milliseconds to seconds.
CACHE_SIZE = 64
# Tokens that end a grammar when the model has no EOS of its own (a synthetic model, a checkpoint without one).
FALLBACK_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")
JSON_SEPARATORS = (", ", ": ")
# Qwen's template writes a newline inside each tag; a model may leave it out (the parser reads both)
TOOL_CALL_START, TOOL_CALL_END = 'root ::= "<tool_call>" "\\n"?', 'root ::= "\\n"? "</tool_call>"'


class GrammarError(ValueError):
    """A grammar that cannot be built or compiled (HTTP 400); `param` names the request field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to. `source` is compact JSON in the request's key order (a schema's
    property order is the order the output writes them), the cache key."""

    kind: str  # "json_schema", "json_object" or "tool_calls"
    source: str = ""
    param: str = "response_format"  # the request field the grammar came from (named in a refusal)

    @classmethod
    def json_schema(cls, schema, param: str = "response_format") -> "GrammarSpec":
        """Output that keeps to `schema`, strict or not (as vLLM, an object has only the properties the schema allows:
        `additionalProperties` absent is false)."""
        if not isinstance(schema, dict):
            raise GrammarError(param, f"'{param}' needs a JSON schema object, got {type(schema).__name__}")
        return cls("json_schema", canonical(schema), param)

    @classmethod
    def json_object(cls, param: str = "response_format") -> "GrammarSpec":
        return cls("json_object", param=param)

    @classmethod
    def tool_calls(cls, tools: Sequence[dict], name: Optional[str], parallel: bool) -> "GrammarSpec":
        """A call of the function `name` (None: any of `tools`); `tools` as OpenAI's function definitions."""
        functions = {tool["name"]: tool.get("parameters") or {"type": "object"} for tool in tools}
        if name is not None:
            if name not in functions:
                raise GrammarError("tool_choice", f"'tool_choice' names the function {name!r}, which is not among "
                                                  f"'tools' ({', '.join(sorted(functions)) or 'none'})")
            functions = {name: functions[name]}
        if not functions:
            raise GrammarError("tool_choice", "'tool_choice' \"required\" needs tools")
        return cls("tool_calls", canonical({"functions": functions, "parallel": parallel}), "tool_choice")


def canonical(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class GrammarCompiler:
    """Compiles `GrammarSpec`s for one tokenizer and vocabulary, keeping the last CACHE_SIZE (an LRU by the spec and
    the tokenizer); thread-safe (the HTTP handlers compile on worker threads)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Sequence[int] = ()) -> None:
        import xgrammar

        backend = getattr(tokenizer, "_tokenizer", None)
        if backend is None:
            raise GrammarError("response_format", f"constrained decoding needs the model's tokenizer.json; this "
                                                  f"server has {tokenizer.source}")
        from transformers import PreTrainedTokenizerFast

        self.xgrammar = xgrammar
        self.vocab_size = vocab_size
        self.stop_ids = tuple(eos_ids) or tuple(i for i in (backend.token_to_id(t) for t in FALLBACK_STOP_TOKENS)
                                                if i is not None)
        info = xgrammar.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=backend),
                                                       vocab_size=vocab_size, stop_token_ids=list(self.stop_ids))
        self.tokenizer_key = f"{tokenizer.source}:{vocab_size}:{self.stop_ids}"
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec):
        """The compiled grammar of `spec`; GrammarError naming `spec.param` when xgrammar refuses it."""
        key = (spec.kind, spec.source, self.tokenizer_key)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            compiled = self._compiler.compile_grammar(self._grammar(spec))
        except (RuntimeError, ValueError, TypeError) as error:
            reason = (str(error).strip().splitlines() or [type(error).__name__])[-1]
            reason = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", reason)[:400]  # xgrammar's "[time] file:line: "
            raise GrammarError(spec.param, f"'{spec.param}' cannot be compiled into a grammar: {reason}") from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _grammar(self, spec: GrammarSpec):
        grammar = self.xgrammar.Grammar
        if spec.kind == "json_object":
            return self._json({"type": "object"}, strict=False)
        if spec.kind == "json_schema":
            return self._json(json.loads(spec.source), strict=True)
        calls = json.loads(spec.source)
        one = grammar.union(*(grammar.concat(
            grammar.from_ebnf(TOOL_CALL_START),
            self._json({"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
                        "required": ["name", "arguments"], "additionalProperties": False}, strict=True),
            grammar.from_ebnf(TOOL_CALL_END)) for name, parameters in calls["functions"].items()))
        if not calls["parallel"]:
            return one
        # one call, then more, each after a newline
        text = str(one).replace("root ::=", "call ::=", 1)
        return grammar.from_ebnf(text + '\nroot ::= call ("\\n" call)*\n')

    def _json(self, schema: dict, strict: bool):
        return self.xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False,
                                                      separators=JSON_SEPARATORS, strict_mode=strict)

    def guide(self, spec: GrammarSpec) -> "Guide":
        return Guide(self.compile(spec), self.vocab_size, self.stop_ids)


class Guide:
    """One sequence's matcher: the token masks of a step's answered rows (`plan`), and the commits (`commit`).
    `finished` once the grammar is complete: the stream then stops."""

    def __init__(self, compiled, vocab_size: int, stop_ids: Sequence[int]) -> None:
        import torch
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled)
        self.words = -(-vocab_size // 32)
        self.stop_ids = frozenset(stop_ids)
        words = [0xFFFFFFFF] * self.words  # every bit but the stop tokens'
        for token in self.stop_ids:
            words[token // 32] &= ~(1 << (token % 32)) & 0xFFFFFFFF
        self._not_stop = torch.tensor([word - (1 << 32) if word >> 31 else word for word in words], dtype=torch.int32)
        self._allocate = lambda rows: xgrammar.allocate_token_bitmask(rows, vocab_size)
        self._row = None  # the mask of the current state, once filled
        self.finished = False
        self._check_state()

    def plan(self, drafts: Sequence[int] = ()) -> tuple[list[int], WireTensor]:
        """(the drafts kept, tensor `token_mask` int32 [kept + 1, words]): the drafts up to the first the grammar
        forbids, would end on, or leads into a dead end, and each answered row's mask (the state before it). The
        matcher is where it was."""
        drafts = list(drafts)
        masks = self._allocate(len(drafts) + 1)
        masks[0] = self._current()
        walked = 0
        for index, token in enumerate(drafts):
            if not self._allows(masks[index], token) or token in self.stop_ids or not self.matcher.accept_token(token):
                drafts = drafts[:index]
                break
            walked += 1
            self.matcher.fill_next_token_bitmask(masks, index + 1)
            if self._only_stop(masks[index + 1]):  # complete, or a dead end: the target's own row picks this token
                drafts = drafts[:index]
                break
        self.matcher.rollback(walked)
        return drafts, WireTensor.from_torch(masks[:len(drafts) + 1].clone())

    def commit(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` (a step's commit, each allowed by its row's mask) the stream keeps: up to the grammar's
        end (a stop token is kept, as an EOS is). ValueError for a token the grammar does not take."""
        for index, token in enumerate(tokens):
            if self.finished:
                return index
            if not self.matcher.accept_token(token):
                raise ValueError(f"token {token} is outside the grammar (the head shard's mask should forbid it)")
            self._row = None
            if token in self.stop_ids or self.matcher.is_terminated():
                self.finished = True
                return index + 1
            self._check_state()
        return len(tokens)

    def _current(self):
        if self._row is None:
            row = self._allocate(1)
            self.matcher.fill_next_token_bitmask(row)
            self._row = row[0]
        return self._row

    def _check_state(self) -> None:
        """Finished when the grammar ended, or only a stop token (or nothing) may follow."""
        if self.matcher.is_terminated() or self._only_stop(self._current()):
            self.finished = True

    def _only_stop(self, row) -> bool:
        return not bool((row & self._not_stop).any())

    @staticmethod
    def _allows(row, token: int) -> bool:
        return bool((int(row[token // 32]) >> (token % 32)) & 1)
