"""Model core: parity with transformers, layer splits, decode vs prefill, chunked vs recurrent, loader."""

from __future__ import annotations

import json

import pytest
import torch

from common.model_config import ConfigError, config_from_dict, load_config
from common.presets import PRESETS, preset_config
from shardd.weights.loading import ModelSource, build_shard
from shardd.engine.reference.delta_rule import chunked_delta_rule, recurrent_delta_rule
from shardd.synthetic.model import synthetic_weights, write_checkpoint
from shardd.weights.reader import WeightError, load_tensors, shard_shapes
from tests.support.reference import hf_logits_and_hidden, hf_model

PROMPT_LEN = 70  # longer than one GDN chunk (64) and than the recurrent threshold


def load_weights(model_dir, config, begin, end):
    """The tensors of the shard owning layers [begin, end), read from a checkpoint as build_shard reads them."""
    return load_tensors(model_dir, shard_shapes(config, begin, end))


def prompt(n: int, vocab: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def run_split(model_dir, splits, tokens, capture=()):
    """Run the model as consecutive layer ranges in one process; return logits and captured layers."""
    source = ModelSource(model_dir=str(model_dir))
    hidden, captured = None, {}
    for begin, end in splits:
        shard = build_shard(source, begin, end)
        state = shard.new_state(max_context=256)
        if begin == 0:
            out = shard.forward(state, 0, tokens=tokens, capture_layers=capture)
        else:
            out = shard.forward(state, 0, hidden=hidden, capture_layers=capture)
        captured.update(out.captured)
        hidden = out.hidden
    return out.logits, captured


@pytest.fixture(scope="module")
def hf_saved_dir(tmp_path_factory):
    """A second config written by transformers' save_pretrained: other heads, head dims, layer pattern, tied head."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    config = Qwen3_5TextConfig(
        vocab_size=300,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=5,
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=8,
        linear_num_key_heads=3,
        linear_num_value_heads=3,
        linear_key_head_dim=12,
        linear_value_head_dim=10,
        linear_conv_kernel_dim=3,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=True,
        initializer_range=0.2,
    )
    model = Qwen3_5ForCausalLM(config)
    with torch.no_grad():  # make the norms and GDN parameters non-trivial so a mistake shows
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.add_(torch.randn_like(p) * 0.2)
    out = tmp_path_factory.mktemp("hfsaved")
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("which", ["ours", "hf_saved"])
def test_logits_match_transformers(which, tiny_dir, hf_saved_dir):
    model_dir = tiny_dir if which == "ours" else hf_saved_dir
    config = load_config(model_dir)
    reference = hf_model(model_dir)
    for n in (PROMPT_LEN, 9):
        tokens = prompt(n, config.vocab_size)
        ref_logits, _ = hf_logits_and_hidden(reference, tokens)
        logits, _ = run_split(model_dir, [(0, config.num_layers)], tokens)
        assert logits.shape == ref_logits.shape
        assert (logits - ref_logits).abs().max().item() <= 1e-4
    if which == "hf_saved":
        assert config.tie_word_embeddings and config.layer_types[0] == "full_attention"


def test_split_ranges_equal_one_range(tiny_dir):
    tokens = prompt(PROMPT_LEN, 320)
    whole, _ = run_split(tiny_dir, [(0, 6)], tokens)
    for splits in ([(0, 3), (3, 6)], [(0, 1), (1, 4), (4, 6)]):
        logits, _ = run_split(tiny_dir, splits, tokens)
        assert torch.equal(logits.argmax(-1), whole.argmax(-1))
        assert (logits - whole).abs().max().item() <= 1e-5


def test_captured_layers_equal_transformers_hidden_states(tiny_dir):
    tokens = prompt(20, 320)
    _, hf_hidden = hf_logits_and_hidden(hf_model(tiny_dir), tokens)
    layers = (0, 2, 3, 4)  # the last layer's HF entry is post-norm, so it is not a layer output
    for splits in ([(0, 6)], [(0, 3), (3, 6)], [(0, 1), (1, 4), (4, 6)]):
        _, captured = run_split(tiny_dir, splits, tokens, capture=layers)
        assert sorted(captured) == list(layers)
        for layer in layers:
            assert (captured[layer] - hf_hidden[layer + 1]).abs().max().item() <= 1e-4


def test_prefill_then_decode_equals_one_forward(tiny_dir):
    tokens = prompt(40, 320)
    shard = build_shard(ModelSource(model_dir=str(tiny_dir)), 0, 6)
    full = shard.forward(shard.new_state(64), 0, tokens=tokens).logits
    state = shard.new_state(64)
    rows = [shard.forward(state, 0, tokens=tokens[:25]).logits]
    for i in range(25, 40):
        rows.append(shard.forward(state, i, tokens=[tokens[i]]).logits)
    stepped = torch.cat(rows)
    assert state.length == 40
    assert (stepped - full).abs().max().item() <= 1e-4


@pytest.mark.parametrize("n", [64, 128, 37, 130, 5])
def test_chunked_equals_recurrent(n):
    g = torch.Generator().manual_seed(n)
    heads, k_dim, v_dim = 3, 16, 8
    q = torch.nn.functional.normalize(torch.randn(heads, n, k_dim, generator=g), dim=-1) * k_dim**-0.5
    k = torch.nn.functional.normalize(torch.randn(heads, n, k_dim, generator=g), dim=-1)
    v = torch.randn(heads, n, v_dim, generator=g)
    decay_g = -torch.rand(heads, n, generator=g) * 2
    beta = torch.rand(heads, n, generator=g)
    s0 = torch.randn(heads, k_dim, v_dim, generator=g)
    s_rec, s_chunk = s0.clone(), s0.clone()
    out_rec = recurrent_delta_rule(q, k, v, decay_g, beta, s_rec)
    out_chunk = chunked_delta_rule(q, k, v, decay_g, beta, s_chunk)
    assert (out_rec - out_chunk).abs().max().item() <= 1e-4
    assert (s_rec - s_chunk).abs().max().item() <= 1e-4


def test_loader_reads_only_its_own_layers(tiny_dir):
    config = load_config(tiny_dir)
    middle = load_weights(tiny_dir, config, 2, 4)
    names = {k.replace("model.language_model.", "") for k in middle.keys_read}
    assert names == set(shard_shapes(config, 2, 4))
    assert all(k.startswith(("model.language_model.layers.2.", "model.language_model.layers.3.")) for k in middle.keys_read)
    head = load_weights(tiny_dir, config, 4, 6)
    assert "lm_head.weight" in head.keys_read and "model.language_model.norm.weight" in head.keys_read
    assert not any("embed_tokens" in k for k in head.keys_read)
    first = load_weights(tiny_dir, config, 0, 1)
    assert "model.language_model.embed_tokens.weight" in first.keys_read
    assert not any(k.startswith("mtp.") for k in first.keys_read + head.keys_read)


def test_loader_errors_name_the_key(tmp_path):
    config = preset_config("tiny")
    out = write_checkpoint(tmp_path / "m", config, seed=0)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.language_model.layers.1.linear_attn.A_log"]
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightError, match="layers.1.linear_attn.A_log"):
        load_weights(out, config, 0, 2)
    wrong = config_from_dict({**PRESETS["tiny"], "intermediate_size": 96})
    with pytest.raises(WeightError, match=r"layers.3.mlp.gate_proj.weight.*\[128, 64\].*\[96, 64\]"):
        load_weights(out, wrong, 3, 4)


def test_config_forms_and_errors(tiny_dir):
    nested = json.loads((tiny_dir / "config.json").read_text())
    assert config_from_dict(nested) == config_from_dict(nested["text_config"])
    text = dict(PRESETS["tiny"])
    assert config_from_dict(text).layer_types == ("linear_attention", "linear_attention", "full_attention") * 2
    with pytest.raises(ConfigError, match="model_type"):
        config_from_dict({**text, "model_type": "llama"})
    with pytest.raises(ConfigError, match="hidden_size"):
        config_from_dict({k: v for k, v in text.items() if k != "hidden_size"})
    with pytest.raises(ConfigError, match="layer_types"):
        config_from_dict({**text, "layer_types": ["linear_attention"] * 5})
    with pytest.raises(ConfigError, match="linear_num_value_heads"):
        config_from_dict({**text, "linear_num_value_heads": 3})
    with pytest.raises(ConfigError, match="rope_type"):
        config_from_dict({**text, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}})


def test_synthetic_in_memory_equals_written(tiny_dir):
    config = preset_config("tiny")
    in_memory = synthetic_weights(config, 0, 6, seed=0)
    loaded = load_weights(tiny_dir, config, 0, 6).tensors
    assert set(in_memory) == set(loaded)
    assert all(torch.equal(in_memory[k], loaded[k]) for k in loaded)
    other_seed = synthetic_weights(config, 0, 1, seed=1)
    assert not torch.equal(other_seed["embed_tokens.weight"], in_memory["embed_tokens.weight"])


def test_deep_synthetic_stays_finite_in_bfloat16():
    """64 layers in bf16 with the synthetic initialisation (narrow, so it runs on a CPU)."""
    deep = config_from_dict({**PRESETS["tiny"], "num_hidden_layers": 64, "full_attention_interval": 4})
    weights = synthetic_weights(deep, 0, 64, seed=0, dtype=torch.bfloat16)
    from shardd.engine.reference.shard import ShardModel

    shard = ShardModel(deep, weights, 0, 64, dtype=torch.bfloat16)
    out = shard.forward(shard.new_state(128), 0, tokens=prompt(80, deep.vocab_size), capture_layers=range(64))
    assert torch.isfinite(out.logits).all()
    assert max(h.float().abs().max().item() for h in out.captured.values()) < 1e3
    assert out.logits.std().item() > 0.5  # not collapsed: the argmax is meaningful


@pytest.mark.parametrize("n", [1, 7, 16, 70])
def test_chunked_states_after_each_token_equal_recurrent(n):
    g = torch.Generator().manual_seed(100 + n)
    heads, k_dim, v_dim = 2, 8, 4
    k = torch.nn.functional.normalize(torch.randn(heads, n, k_dim, generator=g), dim=-1)
    v = torch.randn(heads, n, v_dim, generator=g)
    decay_g = -torch.rand(heads, n, generator=g)
    beta = torch.rand(heads, n, generator=g)
    s0 = torch.randn(heads, k_dim, v_dim, generator=g)
    slots = torch.zeros(n, heads, k_dim, v_dim)
    state = s0.clone()
    chunked_delta_rule(k, k, v, decay_g, beta, state, state_after_each=slots)
    reference = s0.clone()
    for t in range(n):
        recurrent_delta_rule(k[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], decay_g[:, t : t + 1], beta[:, t : t + 1], reference)
        assert (slots[t] - reference).abs().max().item() <= 1e-5
    assert torch.equal(state, slots[-1])
    no_query = s0.clone()
    assert chunked_delta_rule(None, k, v, decay_g, beta, no_query) is None
    assert (no_query - reference).abs().max().item() <= 1e-5
