"""DFlash drafter: block logits against a from-the-formulas reference, incremental context, crop, config, loader."""

import json
import math
import re

import pytest
import torch
from safetensors.torch import save_file

from common.model_config import ConfigError
from common.presets import preset_config
from common.draft_config import build_target_layer_ids, draft_config_from_dict, load_draft_config
from shardd.draft.model import DFlashDrafter
from common.draft_config import synthetic_draft_config
from shardd.draft.synthetic import synthetic_draft_weights, write_draft_checkpoint
from shardd.engine.reference.errors import BadInput, CapacityExceeded, PositionMismatch
from shardd.synthetic.model import synthetic_weights
from shardd.weights.reader import WeightError, draft_name, draft_shapes, load_tensors

TOLERANCE = 1e-4


def load_draft(draft_dir, config):
    """A draft checkpoint's tensors, read as build_drafter reads them."""
    return load_tensors(draft_dir, draft_shapes(config), names=draft_name).tensors


# ---- the reference, written from the DFlash formulas: no cache, plain matmuls, one head at a time ----------


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, positions, theta):
    """x [n, heads, d]: rotate channel pairs (i, i + d/2) by positions * theta^(-2i/d)."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / x.shape[-1])
    angle = positions.double()[:, None] * inv_freq[None, :]
    cos, sin = angle.cos().float()[:, None, :], angle.sin().float()[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def reference_block_logits(cfg, w, embed, lm_head, features, last_token, block_size):
    """Logits [block_size - 1, vocab] of the mask rows, all context rows given at once."""
    eps, heads, kv_heads, d = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    n = features.shape[0]
    context = _rms(features @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    x = embed[[last_token] + [cfg.mask_token_id] * (block_size - 1)]
    block_pos = torch.arange(n, n + block_size)
    key_pos = torch.arange(n + block_size)  # context rows, then the block's own rows
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        sources = torch.cat([context, h])  # the context rows skip the layer norm
        a = p + "self_attn."
        q = _rms((h @ w[a + "q_proj.weight"].T).view(block_size, heads, d), w[a + "q_norm.weight"], eps)
        k = _rms((sources @ w[a + "k_proj.weight"].T).view(-1, kv_heads, d), w[a + "k_norm.weight"], eps)
        q, k = _rope(q, block_pos, cfg.rope_theta), _rope(k, key_pos, cfg.rope_theta)
        v = (sources @ w[a + "v_proj.weight"].T).view(-1, kv_heads, d)
        window = cfg.layer_window(i)
        outputs = []
        for head in range(heads):
            kv = head // (heads // kv_heads)
            scores = q[:, head] @ k[:, kv].T / math.sqrt(d)  # [block, context + block], no causal mask
            if window is not None:  # sliding layer: causal, the w keys ending at the query's own position
                distance = block_pos[:, None] - key_pos[None, :]
                scores = scores.masked_fill((distance < 0) | (distance >= window), float("-inf"))
            outputs.append(torch.softmax(scores, dim=-1) @ v[:, kv])
        x = x + torch.cat(outputs, dim=-1) @ w[a + "o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate * torch.sigmoid(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    x = _rms(x, w["norm.weight"], eps)
    return (x @ lm_head.T)[1:]


# ---- fixtures ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target():
    config = preset_config("tiny")
    weights = synthetic_weights(config, 0, config.num_layers, seed=0)
    return config, weights["embed_tokens.weight"], weights["lm_head.weight"]


# Windows shorter than the 13-14 context rows the tests add; "windowed" also shorter than its block.
DRAFTS = {
    "two-layers": dict(num_layers=2, block_size=8),
    "one-layer-default-ids": dict(num_layers=1, block_size=6),
    "windowed": dict(num_layers=2, block_size=8, target_layer_ids=[0, 2, 4], sliding_window=5, sliding_layers=(0,)),
    # z-lab's Qwen3.6 drafters: sliding layers first, the last layer full
    "sliding-then-full": dict(num_layers=3, block_size=6, sliding_window=11, sliding_layers=(0, 1)),
    "all-sliding": dict(num_layers=2, block_size=8, sliding_window=6, sliding_layers=(0, 1)),
}


def make(target, name, seed=1):
    config, embed, lm_head = target
    draft = synthetic_draft_config(config, **DRAFTS[name])
    weights = synthetic_draft_weights(draft, seed)
    return DFlashDrafter(draft, weights, target_embed=embed, target_lm_head=lm_head), weights


def features(draft, n, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, draft.config.feature_size, generator=gen)


# ---- the model ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", DRAFTS)
def test_block_logits_match_reference(target, name):
    _, embed, lm_head = target
    drafter, weights = make(target, name)
    feats = features(drafter, 13, seed=2)
    state = drafter.new_state(32)
    drafter.add_context(state, feats)
    block = drafter.config.block_size
    ids, logits = drafter.propose(state, 42, block)
    expected = reference_block_logits(drafter.config, weights, embed, lm_head, feats, 42, block)
    assert logits.dtype == torch.float32 and logits.shape == (block - 1, embed.shape[0])
    assert (logits - expected).abs().max() <= TOLERANCE
    assert torch.equal(ids, expected.argmax(dim=-1))
    assert state.length == 13  # proposing changes nothing


def test_window_masks_far_context(target):
    """The windowed layer must see less than full attention would (13 context rows, window 5)."""
    _, embed, lm_head = target
    drafter, weights = make(target, "windowed")
    feats = features(drafter, 13, seed=2)
    state = drafter.new_state(32)
    drafter.add_context(state, feats)
    _, logits = drafter.propose(state, 42, 8)
    unwindowed = DRAFTS["windowed"] | {"sliding_window": None, "sliding_layers": ()}
    full = synthetic_draft_config(target[0], **unwindowed)
    full_logits = reference_block_logits(full, weights, embed, lm_head, feats, 42, 8)
    assert (logits - full_logits).abs().max() > 1e-2


def test_sliding_layers_do_not_see_later_block_rows(target):
    """Sliding layers are causal: with every layer sliding, a mask row's logits do not depend on the rows after it,
    so a shorter block gives the same logits for the rows it has. Full-attention layers see the whole block."""
    for name, causal in (("all-sliding", True), ("two-layers", False)):
        drafter, _ = make(target, name)
        state = drafter.new_state(32)
        drafter.add_context(state, features(drafter, 13, seed=2))
        long, short = drafter.propose(state, 42, 8)[1], drafter.propose(state, 42, 4)[1]
        difference = (long[:3] - short).abs().max()
        assert difference <= 1e-5 if causal else difference > 1e-3, name


def test_one_layer_default_ids_pick_the_middle_layer(target):
    drafter, _ = make(target, "one-layer-default-ids")
    assert drafter.config.target_layer_ids == (3,)


@pytest.mark.parametrize("name", ["two-layers", "windowed", "sliding-then-full"])
def test_incremental_context_equals_all_at_once(target, name):
    _, embed, lm_head = target
    drafter, weights = make(target, name)
    feats = features(drafter, 14, seed=3)
    state = drafter.new_state(32)
    added = 0
    for piece in (5, 1, 4, 3, 1):
        drafter.add_context(state, feats[added : added + piece])
        added += piece
        token = 7 + added
        _, logits = drafter.propose(state, token, 8)
        expected = reference_block_logits(drafter.config, weights, embed, lm_head, feats[:added], token, 8)
        assert (logits - expected).abs().max() <= TOLERANCE, f"after {added} rows"
    whole = drafter.new_state(32)
    drafter.add_context(whole, feats)
    assert torch.allclose(drafter.propose(whole, token, 8)[1], logits, atol=1e-5)


@pytest.mark.parametrize("name", ["two-layers", "windowed", "sliding-then-full"])
def test_crop_then_readd_equals_never_added(target, name):
    drafter, _ = make(target, name)
    first, replacement = features(drafter, 12, seed=4), features(drafter, 5, seed=5)
    state = drafter.new_state(32)
    drafter.add_context(state, first)
    _, before = drafter.propose(state, 9, 8)
    drafter.crop(state, 7)
    assert state.length == 7
    drafter.add_context(state, replacement)

    clean = drafter.new_state(32)
    drafter.add_context(clean, torch.cat([first[:7], replacement]))
    _, after_crop = drafter.propose(state, 9, 8)
    _, expected = drafter.propose(clean, 9, 8)
    assert torch.allclose(after_crop, expected, atol=1e-5)
    assert (after_crop - before).abs().max() > 1e-3  # the rows dropped did matter


def test_crop_to_zero_restarts(target):
    drafter, _ = make(target, "two-layers")
    state, fresh = drafter.new_state(16), drafter.new_state(16)
    drafter.add_context(state, features(drafter, 6, seed=6))
    drafter.crop(state, 0)
    rows = features(drafter, 3, seed=7)
    drafter.add_context(state, rows)
    drafter.add_context(fresh, rows)
    assert torch.equal(drafter.propose(state, 1, 4)[1], drafter.propose(fresh, 1, 4)[1])


def test_bad_requests_are_refused_before_anything_changes(target):
    drafter, _ = make(target, "two-layers")
    state = drafter.new_state(10)
    drafter.add_context(state, features(drafter, 8, seed=8))

    def check(pos, rows, last_token=3, draft_tokens=7):
        drafter.check_propose(state, pos, rows, last_token, draft_tokens)

    check(10, features(drafter, 2, seed=9))  # fills the context exactly
    check(5, None)  # a crop to 5 rows, nothing added
    with pytest.raises(CapacityExceeded, match="context limit 10"):
        check(11, features(drafter, 3, seed=9))
    with pytest.raises(BadInput, match=r"\[n, 128\]"):
        check(10, torch.zeros(2, 64))
    with pytest.raises(BadInput, match="float32 like this drafter, got bfloat16"):
        check(10, features(drafter, 2, seed=9).bfloat16())
    with pytest.raises(PositionMismatch, match="rows 8..8 were never sent"):
        check(10, features(drafter, 1, seed=9))
    with pytest.raises(BadInput, match="cannot end at pos=1"):
        check(1, features(drafter, 2, seed=9))
    with pytest.raises(BadInput, match="vocabulary"):
        check(8, None, last_token=320)
    with pytest.raises(BadInput, match="block_size 8 exceeds the drafter's 7"):
        check(8, None, draft_tokens=8)


def test_state_bytes(target):
    drafter, _ = make(target, "windowed")
    state = drafter.new_state(40)
    assert sum(c.nbytes() for c in state.kv) == drafter.state_bytes_per_sequence(40)


def test_drafter_rejects_a_wrong_head(target):
    config, embed, lm_head = target
    draft = synthetic_draft_config(config, num_layers=1)
    weights = synthetic_draft_weights(draft, 1)
    with pytest.raises(ValueError, match="target_lm_head"):
        DFlashDrafter(draft, weights, target_embed=embed, target_lm_head=torch.ones(config.hidden_size))
    del weights["layers.0.self_attn.k_norm.weight"]
    with pytest.raises(WeightError, match="layers.0.self_attn.k_norm.weight"):
        DFlashDrafter(draft, weights, target_embed=embed, target_lm_head=lm_head)


# ---- config ------------------------------------------------------------------------------------------------


def _raw(**changes):
    raw = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 320,
        "num_target_layers": 6,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "dflash_config": {"block_size": 16, "mask_token_id": 319, "target_layer_ids": [1, 3]},
    }
    raw.update(changes)
    return raw


def test_config_dflash_config_form():
    cfg = draft_config_from_dict(_raw())
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (16, 319, (1, 3))
    assert cfg.feature_size == 128 and cfg.rope_theta == 1e6
    assert cfg.layer_window(0) is None and cfg.layer_window(1) is None


def test_config_top_level_block_size():
    cfg = draft_config_from_dict(_raw(block_size=10, dflash_config={"mask_token_id": 5, "target_layer_ids": [2]}))
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (10, 5, (2,))
    with pytest.raises(ConfigError, match="'dflash_config.block_size' \\(16\\) and 'block_size' \\(8\\)"):
        draft_config_from_dict(_raw(block_size=8))
    with pytest.raises(ConfigError, match="block_size"):
        draft_config_from_dict(_raw(dflash_config={"mask_token_id": 5}))


# The shape of z-lab's published config.json (which keys, and where), values for illustration. Its Qwen3 drafters
# (e.g. z-lab/Qwen3-8B-DFlash-b16): block_size and rope_theta at the top level, dflash_config with the mask id and
# target layers, and the rest of a transformers 4 Qwen3Config alongside ...
PUBLISHED_QWEN3 = {
    "architectures": ["DFlashDraftModel"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "block_size": 16,
    "bos_token_id": 151643,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "dtype": "bfloat16",
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "layer_types": ["full_attention"] * 5,
    "max_position_embeddings": 40960,
    "max_window_layers": 5,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 5,
    "num_key_value_heads": 8,
    "num_target_layers": 36,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "transformers_version": "4.57.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
# ... and its Qwen3.6 drafters: four sliding layers then a full one, window 2048 (z-lab/dflash issue #126 and the
# projects serving z-lab/Qwen3.6-27B-DFlash), and block_size in dflash_config too, as newer drafters carry it.
PUBLISHED_QWEN36 = {
    **PUBLISHED_QWEN3,
    "dflash_config": {"block_size": 16, "mask_token_id": 248077, "target_layer_ids": [1, 16, 31, 46, 61]},
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
    "num_target_layers": 64,
    "rope_theta": 10000000,
    "sliding_window": 2048,
    "use_sliding_window": True,
    "vocab_size": 248320,
}


def test_config_in_the_published_shape():
    qwen3, qwen36 = draft_config_from_dict(PUBLISHED_QWEN3), draft_config_from_dict(PUBLISHED_QWEN36)
    assert (qwen3.block_size, qwen3.mask_token_id, qwen3.rope_theta) == (16, 151669, 1e6)
    assert qwen3.target_layer_ids == (1, 9, 17, 25, 33) and qwen3.feature_size == 5 * 4096
    assert [qwen3.layer_window(i) for i in range(5)] == [None] * 5
    assert (qwen36.block_size, qwen36.mask_token_id, qwen36.rope_theta, qwen36.num_target_layers) == (16, 248077, 1e7, 64)
    assert [qwen36.layer_window(i) for i in range(5)] == [2048] * 4 + [None]
    # YaRN (z-lab's MLX loader passes rope_scaling through) is not implemented: refused by name.
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    with pytest.raises(ConfigError, match="'rope_scaling.rope_type' = 'yarn'"):
        draft_config_from_dict({**PUBLISHED_QWEN36, "rope_scaling": yarn})


def test_config_dflash_fields_at_either_level():
    """SGLang reads these from dflash_config first and the top level second; a config may hold them in both."""
    top = _raw(block_size=16, num_target_layers=None, mask_token_id=319, target_layer_ids=[1, 3], dflash_config={})
    inner = _raw(num_target_layers=None, dflash_config={
        "block_size": 16, "mask_token_id": 319, "target_layer_ids": [1, 3], "num_target_layers": 6,
    })
    both = _raw(block_size=16, mask_token_id=319, dflash_config=inner["dflash_config"])
    configs = [draft_config_from_dict(raw) for raw in (top, inner, both)]
    assert [(c.block_size, c.mask_token_id, c.target_layer_ids) for c in configs] == [(16, 319, (1, 3))] * 3
    assert [c.num_target_layers for c in configs] == [None, 6, 6]
    for name, other in (("mask_token_id", 5), ("target_layer_ids", [1, 2]), ("num_target_layers", 8)):
        with pytest.raises(ConfigError, match=f"'dflash_config.{name}' .* and '{name}' .* disagree"):
            draft_config_from_dict({**both, name: other})
    with pytest.raises(ConfigError, match="'target_layer_ids' names layer 7"):
        draft_config_from_dict({**top, "num_target_layers": 6, "target_layer_ids": [1, 7]})


def test_config_rope_theta_at_either_place():
    assert draft_config_from_dict(_raw(rope_theta=5e5)).rope_theta == 5e5
    legacy = _raw(rope_theta=None, rope_parameters={"rope_type": "default", "rope_theta": 2e6})
    assert draft_config_from_dict(legacy).rope_theta == 2e6
    assert draft_config_from_dict({**legacy, "rope_theta": 2e6}).rope_theta == 2e6
    with pytest.raises(ConfigError, match="'rope_parameters.rope_theta' .* and 'rope_theta' .* disagree"):
        draft_config_from_dict({**legacy, "rope_theta": 1e6})
    with pytest.raises(ConfigError, match="'rope_theta' is missing"):
        draft_config_from_dict(_raw(rope_theta=None))


def test_default_target_layer_ids():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert build_target_layer_ids(28, 1) == [14]
    assert build_target_layer_ids(10, 5) == [1, 2, 4, 6, 7]  # Python's round: halves go to even
    no_ids = {"block_size": 16, "mask_token_id": 1}
    cfg = draft_config_from_dict(_raw(num_target_layers=36, num_hidden_layers=5, dflash_config=no_ids))
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33) and cfg.feature_size == 5 * 64
    with pytest.raises(ConfigError, match="'num_target_layers' is missing"):
        draft_config_from_dict(_raw(num_target_layers=None, dflash_config=no_ids))


@pytest.mark.parametrize(
    "changes,field",
    [
        (dict(dflash_config={"block_size": 16, "target_layer_ids": [1]}), "dflash_config.mask_token_id"),
        (dict(dflash_config={"block_size": 16, "mask_token_id": 1, "target_layer_ids": [6]}), "dflash_config.target_layer_ids"),
        (dict(dflash_config={"block_size": 16, "mask_token_id": 1, "target_layer_ids": []}), "dflash_config.target_layer_ids"),
        (dict(dflash_config={"block_size": 0, "mask_token_id": 1}), "dflash_config.block_size"),
        (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_parameters.rope_type"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
        (dict(num_attention_heads=3), "num_attention_heads"),
        (dict(hidden_size=None), "hidden_size"),
        (dict(layer_types=["full_attention"]), "layer_types"),
        (dict(layer_types=["full_attention", "linear_attention"]), "layer_types[1]"),
        (dict(architectures=["DFlash2DraftModel"]), "architectures"),
    ],
)
def test_config_errors_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=re.escape(f"'{field}'")):
        draft_config_from_dict(_raw(**changes))


def test_config_sliding_window_as_qwen3config():
    sliding = ["sliding_attention", "full_attention"]
    cfg = draft_config_from_dict(_raw(use_sliding_window=True, sliding_window=2048, layer_types=sliding))
    assert (cfg.layer_window(0), cfg.layer_window(1)) == (2048, None)
    cfg = draft_config_from_dict(_raw(use_sliding_window=True, sliding_window=64, max_window_layers=1))
    assert cfg.layer_types == ("full_attention", "sliding_attention") and cfg.layer_window(1) == 64
    # Qwen3Config drops the window unless use_sliding_window is set; without layer_types that leaves full layers,
    cfg = draft_config_from_dict(_raw(sliding_window=2048, max_window_layers=0))
    assert cfg.layer_types == ("full_attention", "full_attention") and cfg.sliding_window is None
    # but sliding layers left without a window are refused, as vLLM and SGLang refuse them.
    with pytest.raises(ConfigError, match=r"'layer_types' makes layers \[0\] sliding_attention, but 'use_sliding_window'"):
        draft_config_from_dict(_raw(sliding_window=2048, layer_types=sliding))
    with pytest.raises(ConfigError, match="'sliding_window' is null"):
        draft_config_from_dict(_raw(use_sliding_window=True, sliding_window=None, layer_types=sliding))


# (field, a value shardd refuses, values it accepts because they change nothing) for each field we do not implement
UNIMPLEMENTED = [
    ("dflash_config.input_embedding_scale", 2.0, [1.0, 1]),
    ("dflash_config.output_multiplier", 0.5, [1.0]),
    ("dflash_config.output_multiplier", True, []),  # not 1.0, whatever Python's True == 1.0 says
    ("dflash_config.final_logit_softcapping", 30.0, [None, 0]),
    ("final_logit_softcapping", 30.0, [None]),
    ("logit_scale", 2.0, [1.0]),
    ("dflash_config.attention_sink_bias", True, [False, None]),
    ("add_swa_attention_sink_bias", True, [False]),
    ("dflash_config.attention_value_scale", 0.707, [None, 1.0]),
    ("dflash_config.causal", True, [None, False]),  # every layer of _raw() is full attention, which is non-causal
    ("is_causal", True, [False]),
    ("dflash_config.use_swa", True, [False]),
    ("dflash_config.swa_window_size", 2048, [None]),
    ("dflash_config.conv_kernel_size", 2, [0]),
    ("dflash_config.conv_group_size", 16, [0]),
    ("dflash_config.selector_rank", 256, [0]),
    ("dflash_config.selector_top_k", 16, [0]),
    ("dflash_config.projector_type", "domino", [None]),
    ("dflash_config.sample_from_anchor", False, [True]),
    ("dflash_config.use_aux_hidden_state", False, [True]),
    ("use_aux_hidden_state", False, [True]),
    ("target_hidden_size", 32, [64, None]),
    ("draft_vocab_size", 100, [320]),
    ("is_neox_style", False, [True]),
    ("rope_is_neox_style", False, [True]),
    ("has_embed_tokens", True, [False]),
    ("has_lm_head", True, [False]),
    ("dflash_config.causal_head", True, []),  # a dflash_config key shardd does not know at all
]


def _with_field(raw, field, value):
    if field.startswith("dflash_config."):
        return {**raw, "dflash_config": {**raw["dflash_config"], field.removeprefix("dflash_config."): value}}
    return {**raw, field: value}


@pytest.mark.parametrize("field,refused,accepted", UNIMPLEMENTED)
def test_unimplemented_fields_are_refused_by_name(field, refused, accepted):
    with pytest.raises(ConfigError, match=re.escape(f"draft config field '{field}' = {json.dumps(refused)} is not")):
        draft_config_from_dict(_with_field(_raw(), field, refused))
    for value in accepted:
        assert draft_config_from_dict(_with_field(_raw(), field, value)) == draft_config_from_dict(_raw())


def test_causality_and_window_switches_are_accepted_where_they_agree():
    mixed = _raw(use_sliding_window=True, sliding_window=64, layer_types=["sliding_attention", "full_attention"])
    all_sliding = {**mixed, "layer_types": ["sliding_attention"] * 2}
    for raw, agreeing, refused in ((mixed, [None], [True, False]), (all_sliding, [None, True], [False])):
        for value in agreeing:
            draft_config_from_dict(_with_field(raw, "dflash_config.causal", value))
        for value in refused:
            with pytest.raises(ConfigError, match="'dflash_config.causal'"):
                draft_config_from_dict(_with_field(raw, "dflash_config.causal", value))
    assert draft_config_from_dict(_with_field(mixed, "dflash_config.swa_window_size", 64)).layer_window(0) == 64
    with pytest.raises(ConfigError, match="'dflash_config.swa_window_size' = 32 .* accepts only null or 64"):
        draft_config_from_dict(_with_field(mixed, "dflash_config.swa_window_size", 32))


def test_config_checks_the_target(target):
    config = target[0]
    draft = draft_config_from_dict(_raw())
    draft.check_target(config)
    with pytest.raises(ConfigError, match="'hidden_size'"):
        draft_config_from_dict(_raw(hidden_size=32, head_dim=8)).check_target(config)
    with pytest.raises(ConfigError, match="'num_target_layers'"):
        draft_config_from_dict(_raw(num_target_layers=8)).check_target(config)
    layer_six = {"block_size": 4, "mask_token_id": 1, "target_layer_ids": [6]}
    unbounded = draft_config_from_dict(_raw(num_target_layers=None, dflash_config=layer_six))
    with pytest.raises(ConfigError, match="names layer 6, outside the target's 0..5"):
        unbounded.check_target(config)
    outside = draft_config_from_dict(_raw(dflash_config={"block_size": 4, "mask_token_id": 320, "target_layer_ids": [1]}))
    with pytest.raises(ConfigError, match="'dflash_config.mask_token_id'"):
        outside.check_target(config)


# ---- checkpoint --------------------------------------------------------------------------------------------


def test_checkpoint_round_trip(target, tmp_path):
    drafter, weights = make(target, "windowed")
    out = write_draft_checkpoint(tmp_path / "draft", drafter.config, seed=1)
    assert load_draft_config(out) == drafter.config
    loaded = load_draft(out, drafter.config)
    assert loaded.keys() == weights.keys() and all(torch.equal(loaded[k], weights[k]) for k in weights)
    assert set(loaded) >= {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.q_norm.weight"}


def test_written_config_has_the_published_shape(target, tmp_path):
    """z-lab's loaders read our config.json: its torch model takes a transformers Qwen3Config and reads
    `config.block_size`, `layer_types`, `sliding_window` and `dflash_config`; its MLX loader indexes the keys below."""
    from transformers import Qwen3Config

    drafter, _ = make(target, "sliding-then-full")
    raw = json.loads((write_draft_checkpoint(tmp_path / "draft", drafter.config, seed=1) / "config.json").read_text())
    c = drafter.config
    mlx_keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings",
                "block_size", "num_target_layers")
    assert all(raw[key] is not None for key in mlx_keys)
    assert (raw["block_size"], raw["rope_theta"], raw["dflash_config"]["block_size"]) == (6, c.rope_theta, 6)
    assert (raw["dflash_config"]["mask_token_id"], raw["dflash_config"]["target_layer_ids"]) == (
        c.mask_token_id, list(c.target_layer_ids))
    hf = Qwen3Config(**raw)
    assert (hf.block_size, hf.sliding_window, hf.rope_parameters["rope_theta"]) == (6, 11, c.rope_theta)
    assert hf.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    assert draft_config_from_dict(hf.to_dict()) == c  # and transformers' re-save reads back the same


def test_checkpoint_with_index(target, tmp_path):
    drafter, weights = make(target, "two-layers")
    out = tmp_path / "draft"
    out.mkdir()
    names = sorted(weights)
    halves = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    for filename, keys in halves.items():
        save_file({k: weights[k] for k in keys}, str(out / filename))
    index = {"weight_map": {k: filename for filename, keys in halves.items() for k in keys}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = load_draft(out, drafter.config)
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)


def test_loader_errors_name_the_key(target, tmp_path):
    drafter, weights = make(target, "two-layers")
    missing = tmp_path / "missing"
    missing.mkdir()
    save_file({k: v for k, v in weights.items() if k != "layers.1.mlp.up_proj.weight"}, str(missing / "model.safetensors"))
    with pytest.raises(WeightError, match=r"missing tensor 'layers.1.mlp.up_proj.weight' \(expected shape \[128, 64\]"):
        load_draft(missing, drafter.config)

    misshaped = tmp_path / "misshaped"
    misshaped.mkdir()
    save_file({**weights, "fc.weight": torch.zeros(64, 192)}, str(misshaped / "model.safetensors"))
    with pytest.raises(WeightError, match=r"'fc.weight' .* has shape \[64, 192\], expected \[64, 128\]"):
        load_draft(misshaped, drafter.config)
    assert draft_shapes(drafter.config)["fc.weight"] == (64, 128)


def test_missing_config_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_draft_config(tmp_path)
