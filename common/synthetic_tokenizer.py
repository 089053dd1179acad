"""The tokenizer and chat template a synthetic model ships: a byte-level BPE built with `tokenizers`, sized to the
preset's vocabulary, and `chat_template.jinja` (ChatML with tools, as Qwen3 writes it).

Ids 0..255 are the 256 bytes in byte order and there are no merges, so any text encodes to exactly its UTF-8
bytes (the ids synthetic models always took); then the special tokens; every id above is a made-up word
("Ġbako"), so the output of random weights decodes to words, not byte noise. Torch-free: the coordinator builds
it in memory for an in-memory `--synthetic` model, `shardctl make-model` writes it beside the weights."""

from __future__ import annotations

import itertools
import json
from functools import lru_cache
from importlib import resources
from pathlib import Path

# Qwen's special tokens (special: stripped by skip_special_tokens), then its tool markers, added but not special as
# Qwen's tokenizers have them (a tool call's text keeps them), in the id order the synthetic models always had.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
BYTES = 256
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def chat_template() -> str:
    """The package's chat template (common/chat_template.jinja)."""
    return resources.files("common").joinpath("chat_template.jinja").read_text(encoding="utf-8")


def _words():
    """Pronounceable made-up words, shortest first, without end: 'ba', 'be', ..., 'baba', ..."""
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    for count in itertools.count(1):
        for parts in itertools.product(syllables, repeat=count):
            yield "".join(parts)


def min_vocab_size() -> int:
    return BYTES + len(SPECIAL_TOKENS) + len(ADDED_TOKENS)


@lru_cache(maxsize=4)
def build_tokenizer_json(vocab_size: int) -> str:
    """tokenizer.json (text) of exactly `vocab_size` ids."""
    # tokenizers only when one is built: importing this module needs none of it
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if vocab_size < min_vocab_size():
        raise ValueError(f"a synthetic tokenizer needs a vocabulary of at least {min_vocab_size()} ids, got {vocab_size}")
    alphabet = _byte_alphabet()
    vocab = {alphabet[b]: b for b in range(BYTES)}
    vocab.update({token: BYTES + i for i, token in enumerate((*SPECIAL_TOKENS, *ADDED_TOKENS))})
    first_word = min_vocab_size()
    for index, word in zip(range(first_word, vocab_size), _words()):
        vocab["\u0120" + word] = index  # "Ġ": the byte-level space, so each word decodes with a space before it
    tokenizer = Tokenizer(models.BPE(vocab={}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    model = json.loads(tokenizer.to_str())
    model["model"]["vocab"] = vocab
    tokenizer = Tokenizer.from_str(json.dumps(model))  # the special tokens, already in the vocabulary, keep ids 256..
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    text = tokenizer.to_str()
    ids = [tokenizer.token_to_id(t) for t in (*SPECIAL_TOKENS, *ADDED_TOKENS)]
    assert ids == list(range(BYTES, first_word)), ids  # the layout this module promises
    assert tokenizer.get_vocab_size() == vocab_size
    return text


def _byte_alphabet() -> list[str]:
    """The byte-level BPE character of each byte (GPT-2's table), so byte b is vocabulary id b."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(BYTES):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(BYTES + extra)
            extra += 1
    return [chars[b] for b in range(BYTES)]


def tokenizer_config() -> dict:
    """tokenizer_config.json: the chat template, the special tokens, as Qwen's checkpoints write it."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": chat_template(),
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "model_max_length": 262144,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
    }


def write_tokenizer(out: Path, vocab_size: int) -> None:
    """tokenizer.json and tokenizer_config.json (with the chat template) into a model directory."""
    out = Path(out)
    (out / "tokenizer.json").write_text(build_tokenizer_json(vocab_size), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n", encoding="utf-8")
