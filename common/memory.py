"""A daemon's memory budget: what it will allocate, line by line, computed from the config and the options before
anything loads (`shardd serve --max-gpu-memory`), so a configuration that cannot fit is refused in one line instead
of running out of memory minutes later; HELLO reports the same breakdown, and `shardctl launch --dry-run` prints it
for every daemon of a launch (torch-free: the daemon and shardctl share it).

The accounting is device-independent (bytes of the tensors the daemon will allocate), so a CPU shard computes and
checks it too; on CUDA the cap is also handed to the allocator (torch.cuda.set_per_process_memory_fraction).
What no tensor of ours owns (the CUDA context, cuBLAS/Triton workspaces, allocator fragmentation) is not counted:
leave some headroom under the card's size.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from common.model_config import ModelConfig
from common.shapes import draft_shapes
from common.sizes import drafter_step_rows
from protocol.layout import CHECKPOINT


GiB = 1 << 30
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
# --prefix-cache-gib auto: a 27B-shaped shard's prefix entries of a few long conversations
PREFIX_CACHE_GPU = 4 * GiB
PREFIX_CACHE_CPU = 1 * GiB
GRAPH_POOL_BYTES = 64 << 20  # what capturing the step's CUDA graphs keeps besides its static buffers (measured < 40 MiB)


class MemoryBudgetError(ValueError):
    """The configuration does not fit the cap; the message is the one line an operator reads."""

    @staticmethod
    def message(plan: "MemoryPlan") -> str:
        return (f"does not fit in --max-gpu-memory {fmt_gib(plan.cap)}: needs {fmt_gib(plan.total)} ({plan.line()}), "
                f"{fmt_gib(plan.total - plan.cap)} over; lower --max-sequences / --max-context / --max-verify-tokens, "
                f"split the layers further, or load an FP8 checkpoint")


def parse_memory(text: str, device_total: int | None) -> int:
    """'24GiB', '24GB', '24000MiB', '25769803776' (bytes) or a fraction of the device '0.9' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"--max-gpu-memory takes a size (24GiB, 24GB, 20000MiB) or a fraction of the device "
                         f"(0.9), got {text!r}")
    value, unit = float(match.group(1)), match.group(2).lower()
    if not unit and value <= 1 and "." in match.group(1):
        if device_total is None:
            raise ValueError(f"--max-gpu-memory {text}: a fraction needs a device whose size is known")
        if value <= 0:
            raise ValueError(f"--max-gpu-memory fraction must be in (0, 1], got {text}")
        return int(value * device_total)
    if value <= 0:
        raise ValueError(f"--max-gpu-memory must be positive, got {text!r}")
    return int(value * _UNITS[unit])


def fmt_gib(nbytes: int) -> str:
    """2.50 GiB, or 12.3 MiB below a GiB."""
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / (1 << 20):.1f} MiB"


@dataclass
class MemoryPlan:
    """Bytes by what holds them (weights, kv_cache, gdn_states, checkpoint_buffers, step_buffers_and_graphs,
    drafter), and the cap they must fit in (None: no cap)."""

    items: dict[str, int] = field(default_factory=dict)
    cap: int | None = None
    weight_parts: dict[str, int] = field(default_factory=dict)  # `weights` by common.shapes.WEIGHT_PARTS

    @property
    def total(self) -> int:
        return sum(self.items.values())

    def fits(self) -> bool:
        return self.cap is None or self.total <= self.cap

    def line(self) -> str:
        return ", ".join(f"{name} {fmt_gib(n)}" for name, n in self.items.items() if n)

    def check(self) -> None:
        if not self.fits():
            raise MemoryBudgetError(MemoryBudgetError.message(self))

    def describe(self) -> dict:
        """HELLO's `memory` field."""
        return {"cap_bytes": self.cap, "total_bytes": self.total, "items": dict(self.items),
                "weight_parts": {name: n for name, n in self.weight_parts.items() if n}}


def feed_forward_row_bytes(config: ModelConfig, dtype_bytes: int) -> int:
    """What the fast step's feed-forward block holds per row: the dense MLP's gate|up and SwiGLU product; or the
    sparse block's (shardd/engine/fast/moe.py) router|shared projection, routing weights and int32 indices (each
    slot's expert and the sort by expert), the k experts' products and weighted outputs, the shared expert's
    product and output, and the block's output."""
    c, moe = config, config.moe
    if moe is None:
        return c.intermediate_size * 3 * dtype_bytes
    k, shared = moe.num_experts_per_tok, moe.shared_expert_intermediate_size
    return ((moe.num_experts + 1 + 2 * shared + k + k * (moe.moe_intermediate_size + c.hidden_size) + shared
             + 2 * c.hidden_size) * dtype_bytes + 4 * k * 4)


def plan_memory(
    config: ModelConfig, begin: int, end: int, *, weight_bytes: dict[str, int], dtype_bytes: int, engine: str,
    max_sequences: int, max_context: int, max_tokens_per_request: int, checkpoint_bytes_per_sequence: int,
    step_rows: int, drafter_bytes: int = 0, cap: int | None = None, prefill_rows: int = 0,
    drafter_state: dict[str, int] | None = None, prefix_cache: int | None = 0, on_gpu: bool = False,
    device_bytes: int | None = None,
) -> MemoryPlan:
    """What a daemon serving layers [begin, end) will allocate with these options. The fast engine allocates every
    sequence slot (plus one scratch slot) at start; the reference engine allocates as sequences open, so its plan is
    the worst case of `max_sequences` open at once. `weight_bytes`: the weights by common.shapes.WEIGHT_PARTS;
    `prefill_rows`: the GPU prefill's graphed piece (0: none)."""
    c = config
    attention = [i for i in range(begin, end) if not c.is_gdn(i)]
    gdn = [i for i in range(begin, end) if c.is_gdn(i)]
    slots = max_sequences + (1 if engine == "fast" else 0)
    positions = max_context + (step_rows if engine == "fast" else 0)  # the fast pools hold a step past the end
    kv = 2 * c.num_key_value_heads * c.head_dim * dtype_bytes * len(attention) * slots * positions
    states = (c.recurrent_state_bytes() + c.conv_state_bytes()) * len(gdn) * slots
    head = begin < end and end == c.num_layers
    items = {
        "weights": sum(weight_bytes.values()),
        "kv_cache": kv,
        "gdn_states": states,
        "checkpoint_buffers": checkpoint_bytes_per_sequence * slots,
    }
    if engine == "fast":
        rows = step_rows
        buffers = rows * (c.hidden_size * 4 * dtype_bytes + feed_forward_row_bytes(c, dtype_bytes)
                          + 2 * c.linear_conv_dim * 4 + c.num_attention_heads * c.head_dim * 3 * dtype_bytes
                          + (c.vocab_size * 4 * 2 if head else 0))
        buffers += (max_context + rows) * c.rotary_dim * dtype_bytes  # the cos / sin tables
        items["step_buffers_and_graphs"] = buffers + GRAPH_POOL_BYTES
    # the largest transient of a prefill request: its chunk's MLP activations (and logits on the head shard)
    tokens = min(max_tokens_per_request, max_context)
    def activations(rows: int) -> int:  # a prefill call's MLP (or experts') activations and residual-stream transients
        return rows * (c.ffn_width * 3 + c.hidden_size * 4) * dtype_bytes

    items["prefill_activations"] = activations(min(tokens, prefill_rows or 1024)) + (
        tokens * c.vocab_size * 4 if head else 0)
    if engine == "fast" and prefill_rows and prefill_rows <= max_context:
        # shardd.engine.fast.prefill.PrefillGraphs, once a piece of prefill_rows has run: a staging copy of one sequence's
        # GDN state, the static buffers (the residual stream, its norm, the SwiGLU product, an attention core's
        # output) and the graphs' pool, the transients of one piece kept
        static = prefill_rows * (c.hidden_size * 3 * dtype_bytes + feed_forward_row_bytes(c, dtype_bytes))
        items["prefill_graphs"] = (c.recurrent_state_bytes() + c.conv_state_bytes()) * len(gdn) + static + (
            activations(prefill_rows) + GRAPH_POOL_BYTES)
    if drafter_bytes:
        items["drafter"] = drafter_bytes
    items.update(drafter_state or {})
    plan = MemoryPlan(items, cap, dict(weight_bytes))
    if prefix_cache is None:  # auto: a default size, within what the cap (else half what the GPU has free) leaves
        prefix_cache = PREFIX_CACHE_GPU if on_gpu else PREFIX_CACHE_CPU
        if cap is not None:
            prefix_cache = max(0, min(prefix_cache, cap - plan.total))
        elif device_bytes is not None:
            prefix_cache = max(0, min(prefix_cache, (device_bytes - plan.total) // 2))
    items["prefix_cache"] = prefix_cache
    return plan


def rollback_bytes_per_sequence(config: ModelConfig, gdn_layers: int, mode: str | None, max_tokens: int) -> int:
    """float32 rollback storage of one sequence on a shard of `gdn_layers` GDN layers (shardd.engine.reference.rollback
    allocates exactly this): `checkpoint` keeps the state after each of `max_tokens` tokens and the one before;
    `replay-ssm` the state before and each token's conv input, key, value, g and beta."""
    if mode is None or not gdn_layers or not max_tokens:
        return 0
    c = config
    recurrent, conv = c.recurrent_state_bytes(), c.conv_state_bytes()
    if mode == CHECKPOINT:
        return gdn_layers * (max_tokens + 1) * (recurrent + conv)
    heads = c.linear_num_value_heads
    per_token = c.linear_conv_dim + heads * (c.linear_key_head_dim + c.linear_value_head_dim + 2)
    return gdn_layers * (recurrent + conv + 4 * max_tokens * per_token)


def hosted_drafter(draft_config, target: ModelConfig, dtype_bytes: int, *, layers: tuple[int, int] | None,
                   engine: str, max_sequences: int, max_context: int, step_rows: int | None) -> tuple[int, dict[str, int]]:
    """(weights, state items) of a drafter hosted beside `layers` (None: a drafter-only daemon), as `shardd serve
    --draft` plans them: its weights with the target embedding and head it borrows where the layers lack them, and
    its contexts and step buffers for `max_sequences`."""
    weights = drafter_weight_bytes(draft_config, target, dtype_bytes,
                                   shares_embedding=layers is not None and layers[0] == 0,
                                   shares_head=layers is not None and layers[1] == target.num_layers)
    rows = drafter_step_rows(draft_config.block_size, max_sequences, step_rows)
    return weights, drafter_state_bytes(draft_config, target.vocab_size, dtype_bytes, engine=engine,
                                        max_sequences=max_sequences, max_context=max_context, step_rows=rows)


def drafter_weight_bytes(draft_config, target: ModelConfig, dtype_bytes: int, *, shares_embedding: bool,
                         shares_head: bool) -> int:
    """A hosted DFlash drafter's weights plus the target embedding / head it reads where its daemon's layers do
    not hold them already."""
    total = sum(math.prod(shape) for shape in draft_shapes(draft_config).values()) * dtype_bytes
    embedding = target.vocab_size * target.hidden_size * dtype_bytes
    return total + (0 if shares_embedding else embedding) + (0 if shares_head else embedding)


def drafter_state_bytes(draft_config, vocab_size: int, dtype_bytes: int, *, engine: str, max_sequences: int,
                        max_context: int, step_rows: int) -> dict[str, int]:
    """A hosted drafter's context K/V for every sequence and, on the fast engine, its steps' buffers
    (shardd/engine/fast/draft.py: R rows of features, residual stream, attention and MLP scratch, the logits)."""
    c = draft_config
    block = c.block_size if engine == "fast" else 0  # the fast caches hold a block past the context
    slots = max_sequences + (1 if engine == "fast" else 0)
    items = {"drafter_context": c.context_bytes(max_context + block, dtype_bytes) * slots}
    if engine == "fast":
        splits = -(-(max_context + block) // 1024)  # shardd.engine.kernels.attention.CHUNK
        per_row = (c.feature_size * 2 * dtype_bytes + c.hidden_size * 4 * dtype_bytes + c.intermediate_size * dtype_bytes
                   + c.num_attention_heads * c.head_dim * 3 * dtype_bytes + vocab_size * dtype_bytes
                   + c.num_attention_heads * splits * (c.head_dim + 2) * 4)
        items["drafter_step"] = step_rows * per_row + (max_context + block) * c.head_dim * 2 * dtype_bytes
    return items
