"""Text <-> token ids for the CLI: a model's own `tokenizer.json`; the synthetic tokenizer for an in-memory
synthetic model (`common.synthetic_tokenizer`, what `make-model` writes); bytes only when the operator names them
(`--tokenizer bytes`). A checkpoint that ships none gets `NoTokenizer`: token ids only, text refused."""

from __future__ import annotations

import json
from pathlib import Path

from common.synthetic_tokenizer import build_tokenizer_json


# `--tokenizer bytes`: the operator asks for byte tokenization by name.
BYTES = "bytes"


class NoTokenizer:
    """A model without tokenizer.json: prompts as token ids work, text is refused (`refusal`, which a server sets to
    its 400), and output has no text, only its ids (as vLLM's --skip-tokenizer-init)."""

    eos_ids: tuple[int, ...] = ()
    source = "none (the model ships no tokenizer.json: token ids only; --tokenizer bytes for UTF-8 bytes)"
    model_dir = None
    refusal: type[Exception] = None  # set below: TokenizerUnavailable

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        raise self.refusal("the model ships no tokenizer.json, so text cannot be tokenized: send token ids, or "
                           "start with --tokenizer DIR (a directory with tokenizer.json) or --tokenizer bytes")

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return ""


class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes; ids above 255 (a synthetic model may emit them)
    decode to nothing. Synthetic models have no EOS."""

    eos_ids: tuple[int, ...] = ()
    source = "bytes (--tokenizer bytes)"
    model_dir = None

    def __init__(self, vocab_size: int = 256):
        if vocab_size < 256:
            raise ValueError(f"a byte tokenizer needs a vocabulary of at least 256 ids, got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def special_ids(self, *texts: str) -> frozenset[int]:
        return frozenset()


class HFTokenizer:
    """A Hugging Face `tokenizer.json` through the `tokenizers` library."""

    synthetic = False

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer  # a byte tokenizer needs none of it

        path = Path(path)
        model_dir = path if path.is_dir() else path.parent
        file = path / "tokenizer.json" if path.is_dir() else path
        try:
            self._tokenizer = Tokenizer.from_file(str(file))
        except Exception as error:  # tokenizers raises a plain Exception for a file it cannot parse
            raise TokenizerUnavailable(f"cannot read the tokenizer {file}: {_first_line(error)}") from None
        self.source = str(file)
        self.model_dir = model_dir
        self.vocab_size = self._tokenizer.get_vocab_size()
        self.eos_ids = _eos_ids_from_config(model_dir)

    @classmethod
    def synthetic_for(cls, vocab_size: int) -> "HFTokenizer":
        """The tokenizer a synthetic model of this vocabulary ships, built in memory."""
        from tokenizers import Tokenizer  # a byte tokenizer needs none of it

        tokenizer = cls.__new__(cls)
        tokenizer._tokenizer = Tokenizer.from_str(build_tokenizer_json(vocab_size))
        tokenizer.source = f"the synthetic model's tokenizer ({vocab_size} ids: bytes, ChatML tokens, made-up words)"
        tokenizer.model_dir = None
        tokenizer.vocab_size = vocab_size
        tokenizer.eos_ids = ()  # synthetic models have no EOS: a generation runs to its length
        tokenizer.synthetic = True
        return tokenizer

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def special_ids(self, *texts: str) -> frozenset[int]:
        """The ids `skip_special_tokens` drops; with `texts`, only those of these token texts."""
        added = self._tokenizer.get_added_tokens_decoder()
        return frozenset(i for i, token in added.items() if token.special and (not texts or token.content in texts))


def load_tokenizer(model_dir: str | None, vocab_size: int, shards=(), *,
                   given: bool = False) -> ByteTokenizer | HFTokenizer | NoTokenizer:
    """The model directory's tokenizer.json when there is one; else the one the shards' HELLO names (the
    daemons' model directory); the synthetic tokenizer for shards of an in-memory synthetic model; for a
    checkpoint that ships none, NoTokenizer (token ids only). Bytes only when asked for by name (`--tokenizer
    bytes`, `given`). A tokenizer the shards name but this host cannot read, a corrupt one, or a `--tokenizer
    DIR` (`given`) without tokenizer.json is refused (TokenizerUnavailable): bytes would be silently wrong text."""
    if given and model_dir == BYTES:
        return ByteTokenizer(vocab_size)
    if model_dir is not None and (Path(model_dir) / "tokenizer.json").is_file():
        return HFTokenizer(model_dir)
    if given:
        raise TokenizerUnavailable(f"--tokenizer {model_dir} holds no tokenizer.json: give the directory of the model's "
                                   f"tokenizer.json (a Hugging Face checkpoint ships one)")
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
    if model_dir is None and shards and all(synthetic_preset(s) for s in shards):
        return HFTokenizer.synthetic_for(vocab_size)
    return NoTokenizer(vocab_size)


def synthetic_preset(shard) -> str | None:
    """The preset of a shard serving an in-memory synthetic model (its fingerprint says so), else None."""
    fingerprint = str((shard.hello.get("model") or {}).get("fingerprint") or "")
    return fingerprint.split(":")[1] if fingerprint.startswith("synthetic:") else None


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:400]


class TokenizerUnavailable(RuntimeError):
    """The model has a tokenizer the coordinator cannot load (or none, and text was asked for); decoding with bytes
    instead would be wrong."""


NoTokenizer.refusal = TokenizerUnavailable


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
