"""OpenAI API request and response models (the subset `shardctl serve` implements), as pydantic classes.

Requests are strict: a field the server does not know is refused (400 naming it) rather than ignored, and a
field it knows but does not implement (`UNSUPPORTED`) is accepted only when it asks for the default. The
`openai` client sends only the fields a caller gives, so ordinary calls pass."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from coordinator.guided import GrammarError, GrammarSpec
from coordinator.serve.limits import SEED_MAX, SEED_MIN

def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown field is a 400 naming it, never silently ignored

    @model_validator(mode="before")
    @classmethod
    def _null_is_left_out(cls, data: Any) -> Any:
        """OpenAI's schema makes its optional fields nullable, and clients that write every field send null for
        those they leave unset (`"stream": null`, `"n": null`, `"service_tier": null`): a null asks for the field's
        default, so it is read as the field left out, a field this server does not implement included. A required
        field stays, and its null is refused."""
        if not isinstance(data, dict):
            return data
        return {key: value for key, value in data.items()
                if value is not None or (key in cls.model_fields and cls.model_fields[key].is_required())}


# Fields of the OpenAI API (and vLLM's extensions) this server knows but does not implement: accepted only when
# the value is the default (the check returns True), refused by name otherwise.
UNSUPPORTED = {
    "logit_bias": lambda value: not value,
    "suffix": lambda value: not value,
    "guided_json": lambda value: False,
    "guided_regex": lambda value: False,
    "guided_choice": lambda value: False,
    "guided_grammar": lambda value: False,
    "guided_decoding_backend": lambda value: False,
    "structured_outputs": lambda value: False,
    "min_p": lambda value: value == 0,
    "min_tokens": lambda value: value == 0,
    "stop_token_ids": lambda value: not value,
    "include_stop_str_in_output": lambda value: value is False,
    "truncate_prompt_tokens": lambda value: False,
    # chat: nothing is stored, and text is the one output modality
    "store": lambda value: value is False,
    "modalities": lambda value: value == ["text"],
}


class StreamOptions(OpenAIModel):
    include_usage: Optional[bool] = None
    continuous_usage_stats: Optional[bool] = None  # vLLM's extension, not implemented: refused when true


class SamplingFields(OpenAIModel):
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=0)
    temperature: Optional[float] = Field(default=None, ge=0, le=2)
    top_p: Optional[float] = Field(default=None, gt=0, le=1)
    top_k: Optional[int] = None  # vLLM's extension; -1 or 0: all tokens
    seed: Optional[int] = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(default=1, ge=1)
    # vLLM's: prompts share cached prefixes only with prompts of the same salt (README, "Prefix caching")
    cache_salt: Optional[str] = Field(default=None, min_length=1, max_length=1024)
    best_of: Optional[int] = None  # only equal to n (vLLM v1 has no best_of either)
    presence_penalty: Optional[float] = Field(default=None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(default=None, gt=0, le=100)  # vLLM's extension
    ignore_eos: bool = False  # vLLM's extension
    skip_special_tokens: bool = True  # vLLM's extension: special tokens are not returned text
    # vLLM's extension: the logprob of each prompt token after the first, and this many most likely tokens
    prompt_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    user: Optional[str] = None
    # UNSUPPORTED: known, refused unless default
    logit_bias: Optional[dict[str, float]] = None
    guided_json: Optional[Any] = None
    guided_regex: Optional[Any] = None
    guided_choice: Optional[Any] = None
    guided_grammar: Optional[Any] = None
    guided_decoding_backend: Optional[Any] = None
    structured_outputs: Optional[Any] = None
    min_p: Optional[float] = None
    min_tokens: Optional[int] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: Optional[bool] = None
    truncate_prompt_tokens: Optional[int] = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def unsupported(self) -> Optional[str]:
        """The first field (dotted inside an object) set to something this server does not implement, or None."""
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            return "stream_options.continuous_usage_stats"
        for name, is_default in UNSUPPORTED.items():
            value = getattr(self, name, None)
            if value is not None and not is_default(value):
                return name
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        return None


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    suffix: Optional[str] = None
    response_format: Optional[dict[str, Any]] = None  # vLLM's extension: json_schema / json_object (constrained)

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_of_the_four_forms(cls, value: Any) -> Any:
        """A prompt in none of OpenAI's four forms (a list mixing strings and token ids, say) is named in one line,
        not as the union's every failed branch."""
        def token_ids(item: Any) -> bool:
            return isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item)

        if isinstance(value, str) or token_ids(value) or (
                isinstance(value, list) and (all(isinstance(p, str) for p in value) or all(map(token_ids, value)))):
            return value
        raise ValueError("'prompt' is a string, a list of strings, a list of token ids or a list of token-id lists")


class FunctionCall(OpenAIModel):
    name: str
    arguments: str


class ToolCall(OpenAIModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl-tool"))
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(OpenAIModel):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ToolDefinition(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None  # an assistant's earlier calls
    tool_call_id: Optional[str] = None  # a tool message: the call it answers
    # What OpenAI-style responses put on an assistant message, so a transcript sent back as it came still
    # parses: accepted empty, refused by name when set (this server would ignore them).
    refusal: Optional[str] = None
    audio: Optional[dict[str, Any]] = None
    function_call: Optional[dict[str, Any]] = None
    annotations: Optional[list[Any]] = None
    reasoning_content: Optional[str] = None

    @model_validator(mode="after")
    def _only_empty_response_fields(self) -> "ChatMessage":
        for name in ("refusal", "audio", "function_call", "annotations", "reasoning_content"):
            value = getattr(self, name)
            if value is not None and value != [] and value != "":
                raise ValueError(f"'{name}' on a message is not supported by this server (value {value!r})")
        return self

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"only text content parts are supported, got {part.get('type')!r}")
            text = part.get("text", "")
            if not isinstance(text, str):
                raise ValueError(f"a text content part's `text` must be a string, got {type(text).__name__}")
            parts.append(text)
        return "".join(parts)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    tools: Optional[list[ToolDefinition]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None  # every call the model writes is returned
    response_format: Optional[dict[str, Any]] = None  # text, json_object or json_schema (constrained decoding)
    add_generation_prompt: bool = True  # vLLM's extension
    chat_template_kwargs: Optional[dict[str, Any]] = None  # vLLM's extension
    store: Optional[bool] = None  # UNSUPPORTED unless false
    modalities: Optional[list[str]] = None  # UNSUPPORTED unless ["text"]


def response_format_grammar(value: Optional[dict[str, Any]], param: str = "response_format"):
    """The grammar (`coordinator.guided.GrammarSpec`) `response_format` asks for; None for text (or none).
    GrammarError naming `param` for a format this server does not know."""
    if value is None or value.get("type") == "text":
        return None
    kind = value.get("type")
    if kind == "json_object":
        return GrammarSpec.json_object(param)
    if kind != "json_schema":
        raise GrammarError(param, f"'{param}' of type {kind!r} is not supported (text, json_object, json_schema)")
    described = value.get("json_schema")
    if not isinstance(described, dict) or not isinstance(described.get("schema"), dict):
        raise GrammarError(param, f"'{param}' of type json_schema needs 'json_schema': {{'name': ..., 'schema': "
                                  f"{{...}}}}")
    return GrammarSpec.json_schema(described["schema"], param)


class TokenizeCompletionRequest(OpenAIModel):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(OpenAIModel):
    model: Optional[str] = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    tools: Optional[list[ToolDefinition]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIModel):
    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict = Field(default_factory=lambda: {"cached_tokens": 0})


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's `Logprob`: one token's logprob at a prompt position, its rank there (1: the most likely) and text."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# vLLM's `prompt_logprobs`: None for the first prompt token, then per token {token id: PromptLogprob} of the prompt's
# token and the most likely ones
PromptLogprobs = list[Optional[dict[int, PromptLogprob]]]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[Literal["stop", "length"]] = None
    prompt_logprobs: Optional[PromptLogprobs] = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: Optional[list[TokenLogprob]] = None


FinishReason = Optional[Literal["stop", "length", "tool_calls"]]


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int = 0
    message: ResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: FinishReason = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: Optional[PromptLogprobs] = None  # vLLM's: the rendered prompt's, as on a completion's choice


class DeltaFunctionCall(BaseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(BaseModel):
    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: FinishReason = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[UsageInfo] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "shardd"
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo
