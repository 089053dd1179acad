"""Text <-> token ids for the CLI: a model's own `tokenizer.json`, or bytes for
synthetic models that ship none."""

from __future__ import annotations

import json
from pathlib import Path


class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes; ids above 255 (a synthetic model may emit them)
    decode to nothing. Synthetic models have no EOS."""

    eos_ids: tuple[int, ...] = ()
    source = "bytes (the model ships no tokenizer)"
    model_dir = None

    def __init__(self, vocab_size: int = 256):
        if vocab_size < 256:
            raise ValueError(f"a byte tokenizer needs a vocabulary of at least 256 ids, got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizer.json` through the `tokenizers` library."""

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer
        except ImportError as error:
            raise ImportError("reading tokenizer.json needs the 'tokenizers' package: pip install tokenizers") from error
        path = Path(path)
        model_dir = path if path.is_dir() else path.parent
        file = path / "tokenizer.json" if path.is_dir() else path
        self._tokenizer = Tokenizer.from_file(str(file))
        self.source = str(file)
        self.model_dir = model_dir
        self.vocab_size = self._tokenizer.get_vocab_size()
        self.eos_ids = _eos_ids_from_config(model_dir)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def load_tokenizer(model_dir: str | None, vocab_size: int, shards=()) -> ByteTokenizer | HFTokenizer:
    """The model directory's tokenizer.json when there is one; else the one the shards' HELLO names (the
    daemons' model directory); bytes only for a model that ships none (synthetic). A tokenizer the shards
    name but this host cannot read is refused (TokenizerUnavailable): bytes would be silently wrong text."""
    if model_dir is not None and (Path(model_dir) / "tokenizer.json").is_file():
        return HFTokenizer(model_dir)
    named = sorted({s.hello.get("tokenizer") for s in shards if s.hello.get("tokenizer")})
    if model_dir is None and named:
        readable = [path for path in named if (Path(path) / "tokenizer.json").is_file()]
        if not readable:
            holders = ", ".join(str(s.endpoint) for s in shards if s.hello.get("tokenizer"))
            raise TokenizerUnavailable(
                f"the model ships a tokenizer ({', '.join(named)} on {holders}) that this host cannot read; "
                f"give --tokenizer DIR (a directory with the model's tokenizer.json)"
            )
        tokenizer = HFTokenizer(readable[0])
        tokenizer.source = f"{readable[0]}/tokenizer.json (named by the shards' HELLO)"
        return tokenizer
    return ByteTokenizer(vocab_size)


class TokenizerUnavailable(RuntimeError):
    """The model has a tokenizer the coordinator cannot load; decoding with bytes instead would be wrong."""


def _eos_ids_from_config(model_dir: Path) -> tuple[int, ...]:
    """`eos_token_id` from generation_config.json, else config.json (or its text_config)."""
    for name in ("generation_config.json", "config.json"):
        file = model_dir / name
        if not file.is_file():
            continue
        config = json.loads(file.read_text())
        for section in (config, config.get("text_config") or {}):
            eos = section.get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return ()
