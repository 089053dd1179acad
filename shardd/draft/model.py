"""DFlash block drafter: a few Qwen3 decoder layers whose block rows attend, non-causally, over [context ; block].

Context rows are the target's captured features (the outputs of `target_layer_ids`, side by side), projected by
`fc` and normalised by `hidden_norm`; every draft layer projects the same rows to its own K/V, which a
`DraftState` keeps per sequence, at positions 0.. in commit order. A proposal embeds
`[last committed token, mask x (B-1)]` with the target's embedding at positions L .. L+B-1 (L = context rows),
runs the layers with the block's own K/V appended after the context K/V (never stored), applies the draft's
`norm` and reads logits with the target's `lm_head` over the B-1 mask rows. The target's final norm is not used.

Full-attention layers attend without a mask. Sliding-window layers (`layer_types[i] == "sliding_attention"`, the
first four of z-lab's Qwen3.6 drafters) are causal: the query at position q sees the keys at q-w+1 .. q, context and
block rows alike. That is how vLLM (`model_executor/models/qwen3_dflash.py`: sliding layers causal, flash-attn window
(w-1, 0)) and SGLang (`srt/models/dflash.py`: AttentionType.DECODER, window_left w-1) run them, and z-lab serves its
sliding drafters through those two (its README installs vLLM PR #40898 "to support interleaved SWA").

Norms here are Qwen3's plain `w * x` RMSNorm, not Qwen3.5's zero-centred `(1 + w)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.model_config import dtype_name
from common.draft_config import DraftConfig
from shardd.engine.reference.errors import BadInput, CapacityExceeded, PositionMismatch
from shardd.engine.reference.mlp import MLP
from shardd.engine.reference.norm import plain_rms_norm
from shardd.engine.reference.rope import RotaryEmbedding, apply_rotary
from shardd.engine.reference.state import KVCache
from shardd.weights.reader import WeightError, draft_shapes


@dataclass
class DraftState:
    """One sequence's context K/V, one KVCache ([num_kv_heads, max_context, head_dim]) per draft layer.

    `length` is the number of context rows held: the committed tokens whose target features were added.
    """

    max_context: int
    kv: list[KVCache]
    length: int = 0


class DraftAttention:
    """Qwen3 attention (q/k RMSNorm per head, full RoPE, GQA): unmasked, or with `window` a causal sliding window."""

    def __init__(self, config: DraftConfig, weights: dict[str, torch.Tensor], prefix: str, window: int | None):
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.window = window
        self.q_proj = weights[f"{prefix}.q_proj.weight"]
        self.k_proj = weights[f"{prefix}.k_proj.weight"]
        self.v_proj = weights[f"{prefix}.v_proj.weight"]
        self.o_proj = weights[f"{prefix}.o_proj.weight"]
        self.q_norm = weights[f"{prefix}.q_norm.weight"]
        self.k_norm = weights[f"{prefix}.k_norm.weight"]

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x [n, hidden] -> key, value [n, kv_heads, head_dim]; key normed and rotated
        n = x.shape[0]
        key = plain_rms_norm(F.linear(x, self.k_proj).view(n, self.num_kv_heads, self.head_dim), self.k_norm, self.eps)
        value = F.linear(x, self.v_proj).view(n, self.num_kv_heads, self.head_dim)
        return apply_rotary(key, cos, sin), value

    def store_context(self, context: torch.Tensor, cache: KVCache, start: int, cos, sin) -> None:
        key, value = self.key_value(context, cos, sin)
        end = start + context.shape[0]
        cache.key[:, start:end] = key.transpose(0, 1)
        cache.value[:, start:end] = value.transpose(0, 1)

    def __call__(self, x: torch.Tensor, cache: KVCache, context_len: int, cos, sin) -> torch.Tensor:
        """x [B, hidden], the normed block rows at positions context_len .. context_len+B-1."""
        block = x.shape[0]
        query = plain_rms_norm(F.linear(x, self.q_proj).view(block, self.num_heads, self.head_dim), self.q_norm, self.eps)
        query = apply_rotary(query, cos, sin)
        key, value = self.key_value(x, cos, sin)

        # No block query reaches a context row more than window-1 positions back, so skip those rows.
        first = 0 if self.window is None else max(0, context_len - self.window + 1)
        keys = torch.cat([cache.key[:, first:context_len], key.transpose(0, 1)], dim=1)  # [kv_heads, S, head_dim]
        values = torch.cat([cache.value[:, first:context_len], value.transpose(0, 1)], dim=1)
        mask = None
        if self.window is not None:
            # Causal window of w keys ending at the query itself: 0 <= q - k < w (flash-attn window_size (w-1, 0)).
            query_pos = torch.arange(context_len, context_len + block, device=x.device)
            key_pos = torch.arange(first, context_len + block, device=x.device)
            distance = query_pos[:, None] - key_pos[None, :]  # [B, S]
            mask = (distance >= 0) & (distance < self.window)
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1)[None],  # [1, heads, B, head_dim]
            keys[None],
            values[None],
            attn_mask=mask,
            scale=self.head_dim**-0.5,
            enable_gqa=True,
        )
        out = out[0].transpose(0, 1).reshape(block, self.num_heads * self.head_dim)
        return F.linear(out, self.o_proj)


class DraftLayer:
    def __init__(self, config: DraftConfig, weights: dict[str, torch.Tensor], index: int):
        prefix = f"layers.{index}"
        self.eps = config.rms_norm_eps
        self.input_layernorm = weights[f"{prefix}.input_layernorm.weight"]
        self.post_attention_layernorm = weights[f"{prefix}.post_attention_layernorm.weight"]
        self.self_attn = DraftAttention(config, weights, f"{prefix}.self_attn", config.layer_window(index))
        self.mlp = MLP(weights, f"{prefix}.mlp")

    def __call__(self, x: torch.Tensor, cache: KVCache, context_len: int, cos, sin) -> torch.Tensor:
        x = x + self.self_attn(plain_rms_norm(x, self.input_layernorm, self.eps), cache, context_len, cos, sin)
        return x + self.mlp(plain_rms_norm(x, self.post_attention_layernorm, self.eps))


class DFlashDrafter:
    """The draft layers plus the target's embedding and lm_head (shared, not copied)."""

    engine = "reference"  # shardd/engine/fast/draft.py's FastDrafter serves the same model as the "fast" engine

    def __init__(
        self,
        config: DraftConfig,
        weights: dict[str, torch.Tensor],
        *,
        target_embed: torch.Tensor,
        target_lm_head: torch.Tensor,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        for name, shape in draft_shapes(config).items():
            if name not in weights:
                raise WeightError(f"draft weights lack {name!r} (expected shape {list(shape)})")
            if tuple(weights[name].shape) != shape:
                raise WeightError(f"draft tensor {name!r} has shape {list(weights[name].shape)}, expected {list(shape)}")
        for name, tensor in (("target_embed", target_embed), ("target_lm_head", target_lm_head)):
            if tensor.dim() != 2 or tensor.shape[1] != config.hidden_size:
                raise ValueError(f"{name} must be [vocab, {config.hidden_size}], got {list(tensor.shape)}")
        if target_embed.shape[0] != target_lm_head.shape[0]:
            raise ValueError(f"target_embed has {target_embed.shape[0]} rows but target_lm_head {target_lm_head.shape[0]}")
        if not 0 <= config.mask_token_id < target_embed.shape[0]:
            raise ValueError(f"mask_token_id {config.mask_token_id} is outside the target vocabulary of {target_embed.shape[0]}")
        weights = {name: t.to(device=self.device, dtype=dtype) for name, t in weights.items()}
        self._weight_bytes = sum(t.nbytes for t in {id(t): t for t in weights.values()}.values())
        self.vocab_size = target_embed.shape[0]
        self.embed_tokens = target_embed.to(device=self.device, dtype=dtype)
        self.lm_head = target_lm_head.to(device=self.device, dtype=dtype)
        self.fc = weights["fc.weight"]
        self.hidden_norm = weights["hidden_norm.weight"]
        self.norm = weights["norm.weight"]
        self.layers = [DraftLayer(config, weights, i) for i in range(config.num_hidden_layers)]
        self.rope = RotaryEmbedding(config.head_dim, config.rope_theta, self.device)

    def weight_bytes(self) -> int:
        """Bytes of the draft's own tensors (the target's embedding and lm_head are borrowed, not counted)."""
        return self._weight_bytes

    # ---- sequences -------------------------------------------------------------------------------

    def new_state(self, max_context: int) -> DraftState:
        c = self.config
        kv = [
            KVCache.allocate(c.num_key_value_heads, max_context, c.head_dim, self.dtype, self.device)
            for _ in range(c.num_hidden_layers)
        ]
        return DraftState(max_context=max_context, kv=kv)

    def release_state(self, state: DraftState) -> None:
        """Nothing to give back: each state owns its tensors (the fast drafter's live in shared slots)."""

    def state_bytes_per_sequence(self, max_context: int) -> int:
        return self.config.context_bytes(max_context, self.dtype.itemsize)

    @property
    def max_draft_tokens(self) -> int:
        """Draft tokens one proposal may ask for: the trained block holds the last committed token too."""
        return self.config.block_size - 1

    def check_propose(
        self, state: DraftState, pos: int, features: torch.Tensor | None, last_token: int, draft_tokens: int
    ) -> None:
        """Validation only, before a proposal changes anything: raises a ModelError.

        `features` [n, feature_size] are the rows of positions pos-n .. pos-1 (None: no new rows); the context is
        then cropped to pos-n rows, those rows appended, and `draft_tokens` drafted after `last_token` at `pos`."""
        c = self.config
        n = 0
        if features is not None:
            n = features.shape[0]
            if features.shape[1] != c.feature_size:
                raise BadInput(
                    f"features must be [n, {c.feature_size}] (target layers {list(c.target_layer_ids)} x "
                    f"hidden {c.hidden_size}, side by side), got {list(features.shape)}"
                )
            if features.dtype != self.dtype:
                raise BadInput(f"features must be {dtype_name(self.dtype)} like this drafter, got {dtype_name(features.dtype)}")
        if draft_tokens > self.max_draft_tokens:
            raise BadInput(
                f"block_size {draft_tokens} exceeds the drafter's {self.max_draft_tokens} draft tokens "
                f"(its block of {c.block_size} includes the last committed token)"
            )
        if last_token >= self.vocab_size:
            raise BadInput(f"last_token {last_token} is outside the vocabulary 0..{self.vocab_size - 1}")
        start = pos - n
        if start < 0:
            raise BadInput(f"{n} feature rows cannot end at pos={pos}")
        if state.length < start:
            raise PositionMismatch(
                f"the drafter's context holds {state.length} rows but these {n} feature rows start at position {start} "
                f"(pos {pos} - {n}): rows {state.length}..{start - 1} were never sent"
            )
        if pos > state.max_context:
            raise CapacityExceeded(f"pos {pos} exceeds the context limit {state.max_context}")

    def crop(self, state: DraftState, length: int) -> None:
        """Drop the context rows past `length` (their tokens were rolled back)."""
        state.length = length

    # ---- compute: the arguments are those check_propose accepted ----------------------------------

    @torch.inference_mode()
    def add_context(self, state: DraftState, features: torch.Tensor) -> None:
        """Append n committed rows: features [n, len(target_layer_ids) * hidden], at positions L .. L+n-1."""
        start, n = state.length, features.shape[0]
        projected = F.linear(features.to(self.device, self.dtype), self.fc)  # [n, hidden]
        context = plain_rms_norm(projected, self.hidden_norm, self.config.rms_norm_eps)
        cos, sin = self.rope.cos_sin(torch.arange(start, start + n, device=self.device), self.dtype)
        for layer, cache in zip(self.layers, state.kv):
            layer.self_attn.store_context(context, cache, start, cos, sin)
        state.length = start + n

    def add_context_batch(self, items: list[tuple[DraftState, torch.Tensor]]) -> None:
        """add_context for each (state, features), one after another (the fast drafter packs them into shared steps)."""
        for state, features in items:
            self.add_context(state, features)

    def propose_batch(self, items: list[tuple[DraftState, int, int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """propose for each (state, last_token, block_size), one after another."""
        return [self.propose(state, last_token, block_size) for state, last_token, block_size in items]

    @torch.inference_mode()
    def propose(self, state: DraftState, last_token: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft block_size-1 tokens after `last_token`, the committed token at position state.length (the one
        whose features are not in the context yet). Returns (ids [block_size-1], logits [block_size-1, vocab] float32).
        The state is not changed."""
        start = state.length
        block = torch.full((block_size,), self.config.mask_token_id, dtype=torch.long, device=self.device)
        block[0] = last_token
        x = F.embedding(block, self.embed_tokens)  # [B, hidden]
        cos, sin = self.rope.cos_sin(torch.arange(start, start + block_size, device=self.device), self.dtype)
        for layer, cache in zip(self.layers, state.kv):
            x = layer(x, cache, start, cos, sin)
        x = plain_rms_norm(x[1:], self.norm, self.config.rms_norm_eps)  # the mask rows [B-1, hidden]
        logits = F.linear(x, self.lm_head).float()  # [B-1, vocab]
        return logits.argmax(dim=-1), logits
