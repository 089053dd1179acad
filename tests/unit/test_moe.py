"""Qwen3.5 MoE on the reference engine: parity with transformers' Qwen3_5MoeForCausalLM through three shards on
checkpoints it saved (shapes drawn from a seed, not chosen by hand), in the hub's per-expert layout and in the fused
layout, with and without the `model.language_model.` prefix; speculative decoding in every rollback mode equals
greedy; a shard reads only its own layers' experts; variants we do not implement are refused by name."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from common.model_config import ConfigError, config_from_dict, load_config
from common.presets import PRESETS, preset_config
from coordinator.benchstats import tokens_digest
from coordinator.decoding import greedy_decode, speculative_decode
from coordinator.drafting.drafters import make_drafter
from protocol.layout import CHECKPOINT, REPLAY, REPLAY_SSM, even_split
from shardd.engine.reference.moe import SparseMoeBlock
from shardd.engine.reference.rollback import RollbackStorage
from shardd.local import LocalTarget
from shardd.synthetic.model import synthetic_weights, write_checkpoint
from shardd.weights.loading import ModelSource, build_shard, daemon_memory_plan
from shardd.weights.reader import WeightError, load_tensors, shard_shapes
from tests.support.reference import _torch_kernels

SEEDS = (11, 23, 37)  # each draws a model shape (experts, top k, widths, heads, layer pattern, tied head)
NEW_TOKENS = 24
BLOCK = 6


def draw_config(seed: int):
    """A tiny Qwen3_5MoeTextConfig whose shape comes from `seed`: three to five layers of both kinds."""
    from transformers import Qwen3_5MoeTextConfig

    rng = random.Random(seed)
    layers = rng.randint(3, 5)
    types = [rng.choice(["linear_attention", "full_attention"]) for _ in range(layers)]
    types[rng.randrange(layers)], types[rng.randrange(layers)] = "linear_attention", "full_attention"
    heads = rng.choice([2, 4])
    key_heads = rng.choice([1, 2])
    experts = rng.randint(3, 9)
    return Qwen3_5MoeTextConfig(
        vocab_size=rng.randint(96, 200),
        hidden_size=rng.choice([16, 24, 32]),
        num_hidden_layers=layers,
        layer_types=types,
        num_attention_heads=heads,
        num_key_value_heads=rng.choice([1, heads]),
        head_dim=rng.choice([8, 12]),
        linear_num_key_heads=key_heads,
        linear_num_value_heads=key_heads * rng.choice([1, 2]),
        linear_key_head_dim=rng.choice([8, 12]),
        linear_value_head_dim=rng.choice([6, 8]),
        linear_conv_kernel_dim=rng.choice([2, 3, 4]),
        num_experts=experts,
        num_experts_per_tok=rng.randint(1, min(4, experts)),
        moe_intermediate_size=rng.choice([8, 12, 20]),
        shared_expert_intermediate_size=rng.choice([8, 16, 24]),
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5},
        tie_word_embeddings=rng.random() < 0.5,
        initializer_range=0.2,
    )


def hf_moe(seed: int):
    """transformers' model of the drawn shape, on the CPU's torch kernels, its norms and GDN parameters perturbed
    so that a mistake shows."""
    from transformers import Qwen3_5MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(draw_config(seed)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.add_(torch.randn_like(p) * 0.2)
    _torch_kernels(model)
    return model


def rewrite(saved, out, *, fused: bool, prefix: str):
    """`saved` (save_pretrained's directory) in another layout: the experts fused as transformers holds them in
    memory, and/or the keys under `model.language_model.`."""
    out.mkdir()
    (out / "config.json").write_text((saved / "config.json").read_text())
    if fused:
        from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

        raw = json.loads((saved / "config.json").read_text())
        model = Qwen3_5MoeForCausalLM.from_pretrained(saved, config=Qwen3_5MoeTextConfig(**raw))
        tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            del tensors["lm_head.weight"]
    else:
        with safe_open(str(saved / "model.safetensors"), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    renamed = {k.replace("model.", prefix, 1) if k.startswith("model.") else k: v for k, v in tensors.items()}
    save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module", params=SEEDS)
def saved(request, tmp_path_factory):
    model = hf_moe(request.param)
    out = tmp_path_factory.mktemp(f"moe{request.param}")
    model.save_pretrained(out)
    return model, out


def prompt(n: int, vocab: int, seed: int = 1) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def three_shards(model_dir, tokens):
    """Logits of `tokens` through three shards in one process, each built from the checkpoint alone."""
    config = load_config(model_dir)
    source, hidden = ModelSource(model_dir=str(model_dir)), None
    for begin, end in even_split(config.num_layers, 3):
        shard = build_shard(source, begin, end)
        state = shard.new_state(128)
        out = shard.forward(state, 0, **({"tokens": tokens} if begin == 0 else {"hidden": hidden}))
        hidden = out.hidden
    return out.logits


@pytest.mark.parametrize("layout", ["per-expert", "per-expert-language-model", "fused", "fused-language-model"])
def test_logits_match_transformers_through_three_shards(saved, layout, tmp_path):
    model, directory = saved
    if layout != "per-expert":
        directory = rewrite(directory, tmp_path / layout, fused=layout.startswith("fused"),
                            prefix="model.language_model." if layout.endswith("language-model") else "model.")
    config = load_config(directory)
    assert config.moe.num_experts == model.config.num_experts
    for n in (70, 5):  # longer than a GDN chunk (64), and a short one
        tokens = prompt(n, config.vocab_size, seed=n)
        with torch.inference_mode():
            expected = model(torch.tensor([tokens]), use_cache=False).logits[0]
        logits = three_shards(directory, tokens)
        assert (logits - expected).abs().max().item() <= 1e-4


def test_the_router_picks_several_experts(saved):
    """Parity above means something only if the tokens spread over the experts (not one expert for all)."""
    _, directory = saved
    config = load_config(directory)
    weights = load_tensors(directory, shard_shapes(config, 0, 1)).tensors
    block = SparseMoeBlock(config.moe, weights, "layers.0.mlp")
    x = torch.randn(64, config.hidden_size, generator=torch.Generator().manual_seed(0))
    experts, weights = block.route(x)
    assert len(torch.unique(experts)) > min(config.moe.num_experts_per_tok, config.moe.num_experts - 1)
    torch.testing.assert_close(weights.sum(-1), torch.ones(64))  # norm_topk_prob, as transformers does


@pytest.mark.parametrize("mode", [CHECKPOINT, REPLAY_SSM, REPLAY])
def test_speculative_equals_greedy_in_every_rollback_mode(saved, mode):
    _, directory = saved
    config = load_config(directory)
    splits = even_split(config.num_layers, 3)
    source = ModelSource(model_dir=str(directory))
    words = prompt(12, config.vocab_size, seed=3)
    greedy = greedy_decode(LocalTarget(source, splits, RollbackStorage(None, 0)), 1, words, NEW_TOKENS).tokens
    storage = RollbackStorage(CHECKPOINT if mode == REPLAY else mode, BLOCK)
    drafter = make_drafter("oracle", prompt_len=len(words), reference=greedy, block_size=BLOCK, mean_commit=2.0,
                           seed=1)
    result = speculative_decode(LocalTarget(source, splits, storage), 2, words, drafter, block_size=BLOCK,
                                rollback=mode, max_new_tokens=NEW_TOKENS)
    assert result.tokens == greedy
    assert result.rollbacks_fast + result.replays > 0  # the oracle erred: a partial accept was rolled back


def test_norm_topk_prob_false_weights_by_the_plain_probabilities():
    """Qwen3.5 MoE checkpoints renormalise the top k (transformers always does); a config saying otherwise gets the
    router's probabilities as they are, as vLLM honours the field."""
    config = config_from_dict({**PRESETS["tiny-moe"], "norm_topk_prob": False})
    weights = synthetic_weights(config, 0, 1, seed=0)
    block = SparseMoeBlock(config.moe, weights, "layers.0.mlp")
    x = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(0))
    experts, chosen = block.route(x)
    probs = torch.softmax(x @ weights["layers.0.mlp.gate.weight"].T, dim=-1)
    torch.testing.assert_close(chosen, probs.gather(1, experts))
    assert (chosen.sum(-1) < 1).all()


def test_a_shard_reads_only_its_own_experts(tmp_path):
    config = preset_config("tiny-moe")
    out = write_checkpoint(tmp_path / "m", config, seed=0, max_file_bytes=64 << 10)
    for begin, end in ((2, 4), (4, 6)):
        read = load_tensors(out, shard_shapes(config, begin, end)).keys_read
        layers = {int(key.split(".")[3]) for key in read if ".layers." in key}
        assert layers == set(range(begin, end))
        experts = [key for key in read if ".mlp.experts." in key]
        assert len(experts) == (end - begin) * config.moe.num_experts * 3
    # and the memory plan counts exactly those bytes (every expert of its layers, no other layer's)
    for begin, end in ((0, 3), (3, 6)):
        shard = build_shard(ModelSource(model_dir=str(out)), begin, end)
        expected = sum(t.nbytes for t in load_tensors(out, shard_shapes(config, begin, end)).tensors.values())
        assert shard.weight_bytes() == expected


def test_memory_plan_counts_the_experts_of_the_daemons_layers():
    """The 397B-A17B shape over 8 daemons, from its config alone: every layer's experts, in bf16."""
    from shardd.config import ShardConfig

    config = preset_config("qwen3.5-397b-a17b")
    moe, h = config.moe, config.hidden_size
    experts_per_layer = moe.num_experts * 3 * moe.moe_intermediate_size * h * 2
    source = ModelSource(synthetic="qwen3.5-397b-a17b")
    totals = []
    for begin, end in even_split(config.num_layers, 8):
        shard = ShardConfig(synthetic="qwen3.5-397b-a17b", layers=(begin, end), dtype="bfloat16", engine="reference",
                            max_sequences=1, max_context=4096, max_verify_tokens=16)
        plan = daemon_memory_plan(source, config, shard)
        assert plan.items["weights"] > (end - begin) * experts_per_layer
        totals.append(plan.items["weights"])
    assert 396e9 < sum(totals) / 2 < 397e9  # 397B parameters in bf16, less the MTP and vision towers (not loaded)


def test_fp8_experts_load_per_expert_and_fused_fp8_is_refused(tmp_path):
    """A block-FP8 MoE checkpoint (as the official -FP8 releases store it: every expert's projections FP8 with their
    scales, the router and shared-expert gate unquantized) loads dequantized on the CPU; fused FP8 experts are
    refused by name."""
    config = preset_config("tiny-moe")
    out = write_checkpoint(tmp_path / "fp8", config, seed=0, quantize="fp8-block")
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.language_model.layers.0.mlp.experts.3.up_proj.weight_scale_inv" in index
    assert "model.language_model.layers.0.mlp.gate.weight_scale_inv" not in index
    quantized = build_shard(ModelSource(model_dir=str(out)), 0, 6)
    plain = build_shard(ModelSource(synthetic="tiny-moe"), 0, 6)
    tokens = prompt(9, config.vocab_size)
    a = quantized.forward(quantized.new_state(32), 0, tokens=tokens).logits
    b = plain.forward(plain.new_state(32), 0, tokens=tokens).logits
    assert a.shape == b.shape and (a - b).abs().max().item() < 0.5  # FP8 rounding, not another model

    fused = tmp_path / "fused-fp8"
    fused.mkdir()
    (fused / "config.json").write_text((out / "config.json").read_text())
    e, width, h = config.moe.num_experts, config.moe.moe_intermediate_size, config.hidden_size
    save_file({"model.language_model.layers.0.mlp.experts.gate_up_proj": torch.zeros(e, 2 * width, h),
               "model.language_model.layers.0.mlp.experts.down_proj": torch.zeros(e, h, width)},
              str(fused / "model.safetensors"))
    with pytest.raises(WeightError, match=r"experts of layer 0 fused.*fp8"):
        build_shard(ModelSource(model_dir=str(fused)), 0, 1)


@pytest.mark.parametrize("change,named", [
    ({"model_type": "qwen3_next"}, "Qwen3-Next"),
    ({"model_type": "qwen3_moe"}, "Qwen3 MoE"),
    ({"mlp_only_layers": [1]}, "mlp_only_layers"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"scoring_func": "sigmoid"}, "scoring_func"),
    ({"n_group": 4, "topk_group": 2}, "n_group"),
    ({"routed_scaling_factor": 2.5}, "routed_scaling_factor"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"num_experts": None}, "num_experts"),
])
def test_moe_variants_we_do_not_implement_are_refused_by_name(change, named, tmp_path):
    raw = {"model_type": "qwen3_5_moe", "text_config": {**PRESETS["tiny-moe"], **change}}
    raw["text_config"] = {k: v for k, v in raw["text_config"].items() if v is not None}
    with pytest.raises(ConfigError, match=named):
        config_from_dict(raw)
    (tmp_path / "config.json").write_text(json.dumps(raw))  # before any weight is read: there are none
    with pytest.raises(ConfigError, match=named):
        build_shard(ModelSource(model_dir=str(tmp_path)), 0, 1)


def test_config_forms_round_trip():
    config = preset_config("tiny-moe")
    assert config_from_dict(config.to_hf_dict()) == config
    assert config_from_dict({"model_type": "qwen3_5_moe", "text_config": config.to_hf_dict()}) == config
    for name in ("qwen3.5-35b-a3b", "qwen3.5-122b-a10b", "qwen3.5-397b-a17b"):
        big = preset_config(name)
        assert big.moe is not None and big.layer_types.count("full_attention") * 4 == big.num_layers
    c = preset_config("qwen3.5-35b-a3b")
    assert (c.num_layers, c.hidden_size, c.moe.num_experts, c.moe.num_experts_per_tok,
            c.moe.moe_intermediate_size) == (40, 2048, 256, 8, 512)


def test_auto_picks_the_fast_engine_for_moe_and_fp8_moe_on_cuda():
    """`shardd serve`'s engine for the MoE preset, unquantized and with FP8 experts: the reference engine on the CPU,
    the fast one on a CUDA device (where triton is installed)."""
    from shardd.config import ShardConfig
    from shardd.engine.select import resolve_engine

    for quantize in (None, "fp8-block", "fp8-channel"):
        assert ShardConfig.from_flags(synthetic="tiny-moe", quantize=quantize, engine="auto").engine == "reference"
    pytest.importorskip("triton")
    assert resolve_engine("auto", "cuda:0") == "fast"  # what from_flags asks on a GPU, whatever the model


def test_make_model_writes_a_small_moe_checkpoint_that_loads(tmp_path):
    from click.testing import CliRunner

    from shardd.cli import main

    out = tmp_path / "tiny-moe"
    result = CliRunner().invoke(main, ["make-model", "--preset", "tiny-moe", "--out", str(out), "--with-drafter"])
    assert result.exit_code == 0, result.output
    raw = json.loads((out / "config.json").read_text())
    assert (raw["model_type"], raw["text_config"]["model_type"]) == ("qwen3_5_moe", "qwen3_5_moe_text")
    assert load_config(out) == preset_config("tiny-moe")
    written = build_shard(ModelSource(model_dir=str(out)), 0, 6)
    in_memory = build_shard(ModelSource(synthetic="tiny-moe"), 0, 6)
    tokens = prompt(9, 320)
    # the same weights (test_model.py checks the writer); the CPU's GEMM may round differently by alignment
    torch.testing.assert_close(written.forward(written.new_state(16), 0, tokens=tokens).logits,
                               in_memory.forward(in_memory.new_state(16), 0, tokens=tokens).logits,
                               rtol=1e-5, atol=1e-5)


def test_serve_runs_fp8_moe_on_the_fast_engine():
    """`shardd serve --synthetic tiny-moe --quantize fp8-block --engine fast` (under Triton's interpreter on the CPU):
    its config keeps the FP8 bytes, the loaded shard's experts stay FP8 in the fast step, and its greedy tokens are
    the reference engine's on the dequantized weights (float32)."""
    pytest.importorskip("triton")
    from shardd.config import ShardConfig
    from shardd.engine.select import serve_with

    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    config = ShardConfig.from_flags(synthetic="tiny-moe", quantize="fp8-block", engine="fast", device=device,
                                    max_sequences=1, max_context=64)
    assert (config.engine, config.keeps_fp8) == ("fast", True)
    loaded = build_shard(config.source(), *config.layers, dtype=config.dtype, device=device,
                         storage=config.storage(), keep_fp8=config.keeps_fp8)
    shard = serve_with(config.engine, loaded, max_sequences=1, max_context=64, step_rows=config.step_rows,
                       prefill_rows=0)
    assert all(layer.moe.experts_gate_up.dtype == torch.float8_e4m3fn for layer in shard.layers)
    tokens = prompt(5, 320)
    fast = greedy_decode(LocalTarget.from_shards([shard], 64), 1, tokens, 4).tokens
    dequantized = LocalTarget(ModelSource(synthetic="tiny-moe", quantize="fp8-block"), [(0, 6)],
                              RollbackStorage(None, 0))
    assert fast == greedy_decode(dequantized, 1, tokens, 4).tokens


def test_generate_over_three_moe_daemons_equals_greedy_in_one_process():
    """The whole path: three `shardd serve` daemons of the tiny MoE preset (engine auto), ngram speculation."""
    from click.testing import CliRunner

    from coordinator.cli import cli

    words = "the quick brown fox jumps over the lazy dog, the quick brown fox"
    local = LocalTarget(ModelSource(synthetic="tiny-moe"), even_split(6, 3), RollbackStorage(None, 0))
    greedy = greedy_decode(local, 1, list(words.encode()), 16).tokens
    result = CliRunner().invoke(cli, ["generate", "--synthetic", "tiny-moe", "--split", "3", "--prompt", words,
                                      "--max-new-tokens", "16", "--drafter", "ngram", "--rollback", "replay-ssm",
                                      "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["sha256"] == tokens_digest(greedy)
    assert [s["layers"] for s in record["shards"]] == [[0, 2], [2, 4], [4, 6]]
