"""A model that answers every chat prompt with one tool call, in Qwen's `<tool_call>` format, and the server of it:
the tool-calling tests of test_openai_api and test_responses_api import the `tool_model` and `tool_server`
fixtures; test_clients builds one that also has a JSON answer for when a grammar forbids the call."""

from __future__ import annotations

import contextlib
import json
from typing import Sequence

import pytest
import torch

from coordinator.launch import ShardSet, launched_sets
from tests.support.served_model import build_tokenizer
from tests.support.serving import Server

CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
MARKERS = ["<tool_call>", "</tool_call>"]
TOOLS_CHATML = (
    "{% if tools %}<|im_start|>system\n# Tools\n\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    "</tools>\n\nReturn each call as <tool_call>{\"name\": <name>, \"arguments\": <args>}</tool_call><|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n{{ message.content }}"
    "{% for call in message.tool_calls %}<tool_call>{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>{{ message.content }}</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "weather in Paris?"}]
# room for a client's prompt: instructor's JSON mode writes the whole schema into a system message
CONTEXT = 2048


def build_tool_model(out, markers_special: bool = False, call: Sequence[str] = (CALL,),
                     answer: str | None = None) -> dict:
    """A model that answers `<tool_call>CALL</tool_call><|im_start|><|im_end|>` after any chat prompt (CALL the tokens
    of `call`, each added to the vocabulary): its layers write nothing to the residual stream, so each next token
    depends on the current one only (a bigram table set in the head). `markers_special`: its tokenizer marks
    `<tool_call>` and `</tool_call>` special. `answer` (one token, none of `call`'s): the second most likely token
    after the prompt, what a grammar that forbids `<tool_call>` (a JSON answer) leaves it to write."""
    from jinja2 import Environment
    from tokenizers import AddedToken, Tokenizer
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    build_tokenizer(out)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    added = MARKERS + list(call) + ([answer] if answer else [])
    tokenizer.add_tokens([AddedToken(text, special=markers_special and text in MARKERS, normalized=False)
                          for text in added])
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "chat_template.jinja").write_text(TOOLS_CHATML)
    ids = {text: tokenizer.token_to_id(text) for text in added + ["<|im_start|>", "<|im_end|>"]}
    prompt_end = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False).ids[-1]
    chain = [prompt_end, ids["<tool_call>"], *(ids[text] for text in call), ids["</tool_call>"], ids["<|im_start|>"],
             ids["<|im_end|>"]]
    torch.manual_seed(1)
    config = Qwen3_5TextConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=12, linear_value_head_dim=12,
        linear_conv_kernel_dim=4, max_position_embeddings=CONTEXT, tie_word_embeddings=False,
    )
    hf = Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():
        for name, weight in hf.named_parameters():
            if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
                weight.zero_()
        embed, head = hf.model.embed_tokens.weight, hf.lm_head.weight
        head.normal_(0, 0.02)
        for current, following in zip(chain, chain[1:]):
            head[following] = 5 * embed[current] / embed[current].norm()
        if answer:
            head[ids[answer]] = 4 * embed[prompt_end] / embed[prompt_end].norm()
    hf.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids["<|im_end|>"]]}))
    environment = Environment(trim_blocks=True, lstrip_blocks=True)
    environment.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False)  # as transformers renders
    template = environment.from_string(TOOLS_CHATML)
    return {"dir": out, "render": template.render,
            "count": lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)}


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    return build_tool_model(tmp_path_factory.mktemp("tools"))


def serve_tool_model(model: dict):
    """The model on one daemon and `shardctl serve` in front of it (a context manager giving the Server)."""
    sets = [ShardSet(("--model", str(model["dir"])), [(0, 2)], "tcp",
                     ("--max-context", str(CONTEXT), "--max-verify-tokens", "8", "--threads", "1"))]

    @contextlib.contextmanager
    def served():
        with launched_sets(sets, ready_timeout_s=120) as ((shard,),):
            with Server("--shards", shard.endpoint, "--tokenizer", str(model["dir"]), "--block-size", "4") as server:
                yield server

    return served()


@pytest.fixture(scope="module")
def tool_server(tool_model):
    with serve_tool_model(tool_model) as server:
        yield server
