"""The model the HTTP tests serve: a checkpoint transformers writes, with a BPE tokenizer.json and a ChatML
template built here, what transformers' greedy decoding gives for its completion and chat prompts, and two real
`shardd serve` daemons holding it. test_serve and test_openai_api import the `model` and `shards` fixtures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from coordinator.launch import ShardSet, launched_sets

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
PROMPT = "Shards hand hidden states along the pipeline"
MAX_CONTEXT = 48
NEW = 10


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [PROMPT, "hello world, the shards say hello", "pipeline of hidden states and tokens",
              "speculative decoding drafts tokens and verifies them"] * 20
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML,
        "eos_token": "<|im_end|>", "bos_token": None, "pad_token": "<|endoftext|>",
    }))


def hf_greedy(model, ids: list[int], n: int, eos: set[int]) -> list[int]:
    out = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            token = int(model(torch.tensor([out])).logits[0, -1].argmax())
            out.append(token)
            if token in eos:
                break
    return out[len(ids):]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The checkpoint, plus what transformers says greedy decoding gives for the completion and chat prompts."""
    from transformers import PreTrainedTokenizerFast, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    out = tmp_path_factory.mktemp("served")
    build_tokenizer(out)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(out))
    vocab = len(tokenizer)
    torch.manual_seed(0)
    config = Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=12, linear_value_head_dim=12, linear_conv_kernel_dim=4,
        initializer_range=0.3, max_position_embeddings=MAX_CONTEXT,
    )
    hf = Qwen3_5ForCausalLM(config).eval()
    hf.save_pretrained(out)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    # EOS from generation_config.json: <|im_end|> and the 4th token greedy decoding gives, so a request ends on it.
    greedy = hf_greedy(hf, prompt_ids, NEW, set())
    eos = [im_end, greedy[3]]
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    chat = [{"role": "user", "content": "hello shards"}]
    chat_ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    chat_ids = chat_ids["input_ids"] if isinstance(chat_ids, dict) or hasattr(chat_ids, "keys") else chat_ids

    def expected(ids, n):
        tokens = hf_greedy(hf, ids, n, set(eos))
        text_tokens = tokens[:-1] if tokens and tokens[-1] in eos else tokens
        return tokens, tokenizer.decode(text_tokens), ("stop" if tokens[-1] in eos else "length")

    return {"dir": out, "eos": eos, "prompt_ids": prompt_ids, "chat": chat, "chat_ids": list(chat_ids),
            "completion": expected(prompt_ids, NEW), "chat_expected": expected(list(chat_ids), NEW),
            "hf": hf, "tokenizer": tokenizer}


@pytest.fixture(scope="module")
def shards(model):
    sets = [ShardSet(("--model", str(model["dir"])), [(0, 2), (2, 4)], "tcp",
                     ("--max-context", str(MAX_CONTEXT), "--max-verify-tokens", "8", "--threads", "1"))]
    with launched_sets(sets, ready_timeout_s=120) as (pair,):
        yield [s.endpoint for s in pair]



def model_name(model) -> str:
    return Path(model["dir"]).resolve().name
