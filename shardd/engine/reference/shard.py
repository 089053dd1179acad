"""A shard: the contiguous layer range [begin, end) of the model, run over a sequence's state."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn.functional as F

from common.model_config import ModelConfig
from protocol.layout import check_layer_range, owns_embedding, owns_head
from shardd.engine.reference import rollback as rb
from shardd.engine.reference.attention import GatedAttention
from shardd.engine.reference.errors import BadInput, CapacityExceeded, ModelError, PositionMismatch, RollbackUnavailable
from shardd.engine.reference.gdn import GatedDeltaNet
from shardd.engine.reference.mlp import MLP
from shardd.engine.reference.moe import SparseMoeBlock
from shardd.engine.reference.norm import rms_norm
from shardd.engine.reference.rope import RotaryEmbedding
from shardd.engine.reference.state import GDNStates, KVCache, PendingStep, SequenceState
from shardd.weights.reader import head_name

if TYPE_CHECKING:
    from shardd.engine.batch import BatchItem


@dataclass
class ShardOutput:
    hidden: torch.Tensor | None = None  # [n, hidden] on a shard without the head
    # [n, vocab] on the head shard, on the shard's device; the GPU step's is a view of its static buffer, valid
    # until the next step (copy it to keep it)
    logits: torch.Tensor | None = None
    ids: torch.Tensor | None = None  # [n] argmax of the logits, on the head shard
    captured: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> its output [n, hidden]


class DecoderLayer:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], index: int):
        prefix = f"layers.{index}"
        self.index = index
        self.eps = config.rms_norm_eps
        self.input_layernorm = weights[f"{prefix}.input_layernorm.weight"]
        self.post_attention_layernorm = weights[f"{prefix}.post_attention_layernorm.weight"]
        self.is_gdn = config.is_gdn(index)
        if self.is_gdn:
            self.linear_attn = GatedDeltaNet(config, weights, f"{prefix}.linear_attn")
        else:
            self.self_attn = GatedAttention(config, weights, f"{prefix}.self_attn")
        self.mlp = MLP(weights, f"{prefix}.mlp") if config.moe is None else \
            SparseMoeBlock(config.moe, weights, f"{prefix}.mlp")

    def __call__(self, x, state: SequenceState, start: int, rope: RotaryEmbedding, recorder=None):
        mixed = rms_norm(x, self.input_layernorm, self.eps)
        if self.is_gdn:
            x = x + self.linear_attn(mixed, state.gdn[self.index], recorder)
        else:
            x = x + self.self_attn(mixed, state.kv[self.index], start, rope)
        return x + self.mlp(rms_norm(x, self.post_attention_layernorm, self.eps))


class ShardModel:
    """The reference engine (shardd.engine.interface.ShardEngine): owns layers [begin, end), plus the embedding and/or the
    final norm and lm_head where protocol.layout says.

    `fingerprint` identifies the weights (ModelSource.fingerprint) so that shards of different checkpoints are
    not mixed; HELLO reports it.
    """

    engine = "reference"  # the readable path (shardd/engine/fast/ has the GPU step, FastShard)
    # any number of tokens per forward takes the same path: no fixed step, no batched step, no graphed prefill
    step_rows = None
    batch_rows = None
    prefill_rows = None
    supports_device_rows = False  # its rows are host tensors or the device's own, never kept for a ring
    rows_out_on_device = False

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        begin: int,
        end: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        storage: rb.RollbackStorage = rb.RollbackStorage(None, 0),
        fingerprint: str = "unidentified",
    ):
        check_layer_range(begin, end, config.num_layers)
        self.config = config
        self.begin, self.end = begin, end
        self.dtype = dtype
        self.device = torch.device(device)
        self.storage = storage
        self.fingerprint = fingerprint
        self.owns_embedding = owns_embedding(begin)
        self.owns_head = owns_head(end, config.num_layers)
        self.layers = [DecoderLayer(config, weights, i) for i in range(begin, end)]
        self._weight_bytes = sum(t.nbytes for t in {id(t): t for t in weights.values()}.values())
        self.gdn_layers = [i for i in range(begin, end) if config.is_gdn(i)]
        self.attention_layers = [i for i in range(begin, end) if not config.is_gdn(i)]
        self.rope = RotaryEmbedding(config.rotary_dim, config.rope_theta, self.device)
        self.embed_tokens = weights.get("embed_tokens.weight") if self.owns_embedding else None
        if self.owns_head:
            self.norm = weights["norm.weight"]
            self.lm_head = weights[head_name(config)]

    def weight_bytes(self) -> int:
        return self._weight_bytes

    # ---- sequences -------------------------------------------------------------------------------

    def new_state(self, max_context: int) -> SequenceState:
        c = self.config
        kv = {
            i: KVCache.allocate(c.num_key_value_heads, max_context, c.head_dim, self.dtype, self.device)
            for i in self.attention_layers
        }
        gdn = GDNStates.allocate(
            self.gdn_layers,
            c.linear_conv_kernel_dim - 1,
            c.linear_conv_dim,
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim,
            self.device,
        )
        storage = rb.allocate_storage(c, self.gdn_layers, self.storage, self.device)
        return SequenceState(max_context=max_context, kv=kv, gdn=gdn, rollback_storage=storage)

    def release_state(self, state: SequenceState) -> None:
        """A closed sequence's state; nothing to give back here (a pooled shard returns its slot)."""

    def check_rollback_storage(self, n: int = 0) -> None:
        """Raises RollbackUnavailable unless this shard can roll back a checkpointed step of `n` tokens."""
        if not self.storage.enabled:
            raise RollbackUnavailable("this shard was started without rollback storage (--max-verify-tokens 0)")
        if n > self.storage.max_verify_tokens:
            raise RollbackUnavailable(f"rollback storage holds at most {self.storage.max_verify_tokens} tokens per step, got {n}")

    def checkpoint_bytes_per_sequence(self) -> int:
        return rb.storage_bytes_per_sequence(self.config, self.gdn_layers, self.storage)

    def state_bytes_per_sequence(self, max_context: int) -> int:
        c = self.config
        kv = 2 * c.num_key_value_heads * max_context * c.head_dim * self.dtype.itemsize
        gdn = c.recurrent_state_bytes() + c.conv_state_bytes()
        return kv * len(self.attention_layers) + gdn * len(self.gdn_layers)

    # ---- forward ---------------------------------------------------------------------------------

    def check_forward(
        self,
        state: SequenceState,
        pos: int,
        *,
        tokens: list[int] | None = None,
        hidden: torch.Tensor | None = None,
        checkpoint: bool = False,
    ) -> int:
        """Validation only: raises a ModelError and changes nothing. Returns the number of new tokens.

        What the codec checks on the wire is trusted: exactly one of tokens / hidden, at least one token, token ids
        >= 0, hidden 2-D. This checks what only the model knows: its vocabulary, hidden size, dtype, and the state."""
        if self.owns_embedding:
            if tokens is None:
                raise BadInput(f"shard {self.begin}:{self.end} owns the embedding: send tokens, not hidden")
            n = len(tokens)
            bad = [t for t in tokens if t >= self.config.vocab_size]
            if bad:
                raise BadInput(f"token id {bad[0]} is outside the vocabulary 0..{self.config.vocab_size - 1}")
        else:
            if hidden is None:
                raise BadInput(f"shard {self.begin}:{self.end} starts at layer {self.begin}: send hidden, not tokens")
            if hidden.shape[1] != self.config.hidden_size:
                raise BadInput(f"hidden must be [n, {self.config.hidden_size}], got {list(hidden.shape)}")
            if hidden.dtype != self.dtype:
                raise BadInput(f"hidden must be {self.dtype} like this shard, got {hidden.dtype}")
            n = hidden.shape[0]
        if pos != state.length:
            raise PositionMismatch(f"pos={pos} but the sequence's committed length is {state.length}")
        if pos + n > state.max_context:
            raise CapacityExceeded(f"{pos}+{n} tokens exceed the context limit {state.max_context}")
        if checkpoint:
            self.check_rollback_storage(n)
        return n

    @torch.inference_mode()
    def forward(
        self,
        state: SequenceState,
        pos: int,
        *,
        tokens: list[int] | None = None,
        hidden: torch.Tensor | None = None,
        checkpoint: bool = False,
        capture_layers: tuple[int, ...] | list[int] = (),
    ) -> ShardOutput:
        """Append n tokens at `pos` (== committed length). With `checkpoint` the step stays pending for one rollback."""
        n = self.check_forward(state, pos, tokens=tokens, hidden=hidden, checkpoint=checkpoint)
        if self.owns_embedding:
            x = F.embedding(torch.tensor(tokens, dtype=torch.long, device=self.device), self.embed_tokens)
        else:
            x = hidden.to(device=self.device, dtype=self.dtype)

        state.pending = None  # a new step ends the previous pending window: all its tokens are kept
        wanted = set(capture_layers)
        out = ShardOutput()
        for layer in self.layers:
            recorder = state.rollback_storage.recorders[layer.index] if checkpoint and layer.is_gdn else None
            x = layer(x, state, pos, self.rope, recorder)
            if layer.index in wanted:
                out.captured[layer.index] = x
        state.length = pos + n
        if checkpoint:
            state.pending = PendingStep(start=pos, n=n)
        if self.owns_head:
            out.logits = F.linear(rms_norm(x, self.norm, self.config.rms_norm_eps), self.lm_head).float()
            out.ids = out.logits.argmax(dim=-1)
        else:
            out.hidden = x
        return out

    def forward_batch(self, items: Sequence[BatchItem]) -> list[ShardOutput | ModelError]:
        """The items one after another, each as `forward` runs it: the same results as one batched step."""
        results: list[ShardOutput | ModelError] = []
        for item in items:
            try:
                out = self.forward(item.state, item.pos, tokens=item.tokens, hidden=item.hidden,
                                   checkpoint=item.checkpoint, capture_layers=item.capture_layers)
                if not item.logits:
                    out.logits = None
            except ModelError as error:
                out = error
            results.append(out)
        return results

    # ---- rollback (shardd/engine/reference/rollback.py) -------------------------------------------------------

    def rollback(self, state: SequenceState, keep: int) -> None:
        rb.rollback(state, keep)

    def snapshot(self, state: SequenceState) -> None:
        rb.snapshot(state)

    def restore(self, state: SequenceState) -> None:
        rb.restore(state)

    def settle(self, state: SequenceState) -> None:
        """Nothing to do: a reference rollback leaves the state in place."""

    def describe(self) -> dict:
        """Nothing beyond the daemon's counters: the reference has no graphs."""
        return {}
