"""The model's chat template, rendered the way `transformers` renders it (`apply_chat_template`): a sandboxed
jinja2 environment with `raise_exception`, `strftime_now` and a `tojson` that keeps non-ASCII text, the
template from `chat_template.jinja` or `tokenizer_config.json`'s `chat_template`, and the special tokens that
file names. jinja2 directly, as vLLM's and llama.cpp's servers do, keeps the coordinator free of torch.
`chat_prompt` turns a chat request's messages and tools into prompt ids (a template that refuses them: a 400)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

from coordinator.serve.engine import Engine, RequestError
from coordinator.serve.tools import template_messages


class ChatTemplateError(ValueError):
    """No chat template, or one that refuses these messages."""


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str], origin: str) -> None:
        # jinja2 is the serve extra's: importing this module needs none of it
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.template = env.from_string(source)
        # OpenAI's `developer` role is its `system`: a template that never names it gets it as `system`
        self.knows_developer = "developer" in source
        self.special_tokens = special_tokens
        self.origin = origin

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, /, **kwargs: Any) -> str:
        from jinja2.exceptions import TemplateError

        # What the server itself passes the template is not the client's to replace (chat_template_kwargs).
        reserved = sorted(set(kwargs) & ({"messages", "add_generation_prompt", *self.special_tokens}
                                         | set(self.template.environment.globals)))
        if reserved:
            raise ChatTemplateError(f"chat_template_kwargs.{reserved[0]} is set by the server and cannot be "
                                    f"given: {', '.join(reserved)}")
        if not self.knows_developer:
            messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
        try:
            return self.template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens, **kwargs
            )
        except TemplateError as error:
            raise ChatTemplateError(f"the chat template refused the messages: {error}") from None
        except (TypeError, ValueError, AttributeError, KeyError, IndexError, ArithmeticError, RecursionError) as error:
            # a kwarg of a type the template does not expect fails inside it: the request's fault, not a 500
            raise ChatTemplateError(f"the chat template failed on these messages or chat_template_kwargs: "
                                    f"{type(error).__name__}: {error}") from None


def _token_text(value: Any) -> Optional[str]:
    if isinstance(value, dict):  # an AddedToken written out: {"content": "<|im_end|>", ...}
        return value.get("content")
    return value if isinstance(value, str) else None


def load_chat_template(model_dir: Optional[str | Path]) -> Optional[ChatTemplate]:
    """The template a model directory ships, or None."""
    if model_dir is None:
        return None
    model_dir = Path(model_dir)
    config_file = model_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    special = {name: _token_text(config.get(name)) or "" for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return ChatTemplate(jinja_file.read_text(), special, str(jinja_file))
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the "default" one
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    if isinstance(template, str):
        return ChatTemplate(template, special, f"{config_file} (chat_template)")
    return None


def chat_prompt(engine: Engine, messages, tools, add_generation_prompt: bool, kwargs) -> list[int]:
    """A chat request's prompt ids: its messages and tools rendered by the model's template, then tokenized."""
    if engine.chat_template is None:
        raise RequestError("the model ships no chat template (chat_template.jinja or tokenizer_config.json's "
                           "chat_template); use /v1/completions")
    extra = dict(kwargs or {})
    if tools:
        extra["tools"] = [tool.model_dump(exclude_none=True) for tool in tools]
    try:
        text = engine.chat_template.render(template_messages(messages), add_generation_prompt, **extra)
    except (ChatTemplateError, ValueError) as error:
        raise RequestError(str(error)) from None
    return engine.tokenizer.encode(text)
