"""`FastDrafter`: the DFlash drafter (shardd/draft/model.py) as two fixed-shape multi-sequence steps captured as
CUDA graphs, sequences in rows as in the target's step (shardd/engine/fast/step.py).

- the context step: R rows of feature rows, each sequence's contiguous -> `fc` -> `hidden_norm` -> per layer the
  fused k|v GEMM and the attention kernel's append (k norm, RoPE, written in place into each sequence's cache slot
  at its context length);
- the block step: R rows holding up to S blocks of at most T = block_size rows `[last token, mask, ...]` through the
  layers (fused q|k|v and gate|up, the target's split-KV attention kernels over context + block: non-causal within
  the block, causal with a window in sliding layers), the final norm, the head's GEMM and argmax on the device.

Both read each sequence's slot, number of rows, position and first row from a device `control` table (the target
step's, shardd/engine/kernels/segments.py), so one graph serves every set of sequences, block sizes and context
lengths; the shape never changes, so a sequence's drafts do not depend on who shares its step, and the weights are
read once per step whatever the number of sequences. The block's own K/V go into the cache past the context (never
counted in it: the next context rows overwrite them), so attention reads context and block from one place. The
reference drafter stays the readable model and owns validation (check_propose).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from shardd.draft.model import DFlashDrafter
from shardd.engine.fast.graph import CapturedCall
from shardd.engine.fast.weights import _fuse
from shardd.engine.kernels import attention as attention_kernels
from shardd.engine.kernels import elementwise
from shardd.engine.kernels import segments
from shardd.engine.reference.state import KVCache


@dataclass
class FastDraftState:
    """One sequence's drafter context: a slot of the drafter's caches and the number of context rows it holds;
    `kv` views the slot's keys and values per layer as the reference's DraftState holds them ([kv_heads,
    positions, head_dim]), so prefix entries copy a context in and out the same way for both."""

    slot: int
    max_context: int
    length: int = 0
    kv: list[KVCache] = field(default_factory=list, compare=False, repr=False)


@dataclass
class _DraftLayer:
    input_layernorm: torch.Tensor
    post_attention_layernorm: torch.Tensor
    qkv: torch.Tensor  # [(H + 2 * HKV) * D, hidden]: q | k | v
    kv: torch.Tensor   # the k | v rows of qkv (a view): the context step's projection
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o_proj: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor
    window: int  # 0: full attention


def fuse_draft_layers(drafter: DFlashDrafter) -> list[_DraftLayer]:
    """The reference layers' matrices fused in place (the reference keeps views into them: no extra memory)."""
    c = drafter.config
    q_rows = c.num_attention_heads * c.head_dim
    fused = []
    for layer in drafter.layers:
        attn = layer.self_attn
        qkv = _fuse(attn, ["q_proj", "k_proj", "v_proj"])
        fused.append(_DraftLayer(
            layer.input_layernorm, layer.post_attention_layernorm, qkv, qkv[q_rows:], attn.q_norm, attn.k_norm,
            attn.o_proj, _fuse(layer.mlp, ["gate_proj", "up_proj"]), layer.mlp.down_proj, attn.window or 0,
        ))
    return fused


class FastDrafter:
    """Serves in place of a DFlashDrafter (same new_state / check_propose / crop / add_context(_batch) /
    propose(_batch)). `step_rows` is R, the rows of both steps (default T rows per sequence for up to 8 sequences,
    never more than `max_sequences` fill)."""

    engine = "fast"

    def __init__(self, reference: DFlashDrafter, *, max_sequences: int, max_context: int,
                 use_graphs: bool | None = None, step_rows: int | None = None):
        self.reference = reference
        c, device, dtype = reference.config, reference.device, reference.dtype
        self.config, self.device, self.dtype, self.vocab_size = c, device, dtype, reference.vocab_size
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)
        self.rows = c.block_size  # T: one sequence's block (last committed token + the drafts)
        if step_rows is None:
            step_rows = self.rows * min(max_sequences, 8)
        if step_rows < self.rows:
            raise ValueError(f"the drafter's step of {step_rows} rows must hold one block of {self.rows}")
        self.batch_rows = rows = step_rows  # R
        self.max_segments = min(max_sequences, rows // self.rows)  # blocks one step holds (and context segments)
        self.max_context = max_context
        self.scratch_slot = max_sequences
        self.free = list(range(max_sequences - 1, -1, -1))
        self.layers = fuse_draft_layers(reference)
        heads, kv_heads, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        # the cache holds the context and, past it, the block's own K/V (positions up to max_context + T - 1)
        cache_len = max_context + self.rows
        shape = (max_sequences + 1, kv_heads, cache_len, d)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.layers]

        def zeros(*size, dtype=dtype):
            return torch.zeros(size, dtype=dtype, device=device)

        control_size = segments.size(self.max_segments, rows)
        self.features = zeros(rows, c.feature_size)
        self.context = zeros(rows, c.hidden_size)
        self.context_normed = zeros(rows, c.hidden_size)
        self.context_control = zeros(control_size, dtype=torch.int32)
        self.tokens = zeros(rows, dtype=torch.long)
        self.control = zeros(control_size, dtype=torch.int32)
        self.hidden = zeros(rows, c.hidden_size)
        self.normed = zeros(rows, c.hidden_size)
        self.query = zeros(rows, heads, d)
        self.key_scratch = zeros(rows, kv_heads, d)
        self.attn_out = zeros(rows, heads * d)
        splits = attention_kernels.num_splits(cache_len)
        self.partials = (zeros(rows, heads, splits, dtype=torch.float32), zeros(rows, heads, splits, dtype=torch.float32),
                         zeros(rows, heads, splits, d, dtype=torch.float32))
        self.act = zeros(rows, c.intermediate_size)
        self.logits: torch.Tensor | None = None  # the head's output [R, vocab] in the drafter's dtype (the block step's)
        self.ids = zeros(rows, dtype=torch.long)
        positions = torch.arange(cache_len, device=device)
        self.cos, self.sin = (t.contiguous() for t in reference.rope.cos_sin(positions, dtype))

        if use_graphs is None:
            use_graphs = device.type == "cuda"
        pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self.context_step = CapturedCall(self._context_step, use_graphs=use_graphs, pool=pool)
        self.block_step = CapturedCall(self._block_step, use_graphs=use_graphs, pool=pool)
        pin = device.type == "cuda"
        self._features = torch.zeros((rows, c.feature_size), dtype=dtype, pin_memory=pin)
        self._tokens = torch.zeros(rows, dtype=torch.long, pin_memory=pin)
        self._control = torch.zeros(control_size, dtype=torch.int32, pin_memory=pin)
        self._context_control = torch.zeros(control_size, dtype=torch.int32, pin_memory=pin)
        self._ids = torch.zeros(rows, dtype=torch.long, pin_memory=pin)
        # the copies out of the context step's pinned buffers, queued (refilled only once they are done); the block
        # step's are always done when its next use comes: every block step ends with a wait for its ids
        self._staged = torch.cuda.Event() if pin else None
        if use_graphs:  # capture now, on the scratch slot, so no request pays for it and no sequence is touched
            empty = self._table([segments.segment(self.scratch_slot, 1, 0)])
            self.context_control.copy_(empty)
            self.control.copy_(empty)
            self.context_step.capture()
            self.block_step.capture()
            torch.cuda.synchronize(device)

    def _table(self, table: list[list[int]]) -> torch.Tensor:
        """The control of a step over `table`'s segments (the target step's layout)."""
        return torch.tensor(segments.table(table, self.max_segments, self.scratch_slot, self.batch_rows),
                            dtype=torch.int32)

    def weight_bytes(self) -> int:
        return self.reference.weight_bytes()

    @property
    def max_draft_tokens(self) -> int:
        return self.reference.max_draft_tokens

    # ---- sequences -------------------------------------------------------------------------------

    def new_state(self, max_context: int) -> FastDraftState:
        if max_context > self.max_context:
            raise ValueError(f"this drafter's slots hold {self.max_context} rows, asked for {max_context}")
        if not self.free:
            raise MemoryError(f"all {self.scratch_slot} drafter slots are in use")
        slot = self.free.pop()
        return FastDraftState(slot=slot, max_context=max_context,
                              kv=[KVCache(key[slot], value[slot]) for key, value in zip(self.keys, self.values)])

    def release_state(self, state: FastDraftState) -> None:
        self.free.append(state.slot)

    def state_bytes_per_sequence(self, max_context: int) -> int:
        return self.config.context_bytes(max_context + self.rows, self.dtype.itemsize)  # a block past the context

    def check_propose(self, state, pos, features, last_token, draft_tokens) -> None:
        self.reference.check_propose(state, pos, features, last_token, draft_tokens)

    def crop(self, state: FastDraftState, length: int) -> None:
        state.length = length

    # ---- compute: the arguments are those check_propose accepted ----------------------------------

    def add_context(self, state: FastDraftState, features: torch.Tensor) -> None:
        self.add_context_batch([(state, features)])

    def propose(self, state: FastDraftState, last_token: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        [proposal] = self.propose_batch([(state, last_token, block_size)])
        return proposal

    @torch.inference_mode()
    def add_context_batch(self, items: list[tuple[FastDraftState, torch.Tensor]]) -> None:
        """Append each sequence's n committed rows' features [n, feature_size] at its positions state.length ..;
        the sequences' rows packed into context steps of R rows (a long prompt over several), a sequence at most
        once per step."""
        pending = [(state, features, 0) for state, features in items if features.shape[0]]
        while pending:
            if self._staged is not None:
                self._staged.synchronize()  # the last copies out of the pinned buffers are done
            table, later, used, host = [], [], 0, []
            for state, features, done in pending:
                if used == self.batch_rows or len(table) == self.max_segments or any(
                        s[segments.SLOT] == state.slot for s in table):
                    later.append((state, features, done))
                    continue
                n = min(features.shape[0] - done, self.batch_rows - used)
                if features.device == self.features.device:  # already here (a verify's own captures): copied in
                    self.features[used:used + n].copy_(features[done:done + n])
                else:  # host rows, staged in pinned memory, then one copy per step
                    self._features[used:used + n].copy_(features[done:done + n])
                    host.append((used, used + n))
                table.append(segments.segment(state.slot, n, state.length, first=used))
                state.length += n
                used += n
                if done + n < features.shape[0]:
                    later.append((state, features, done + n))
            for begin, end in host:
                self.features[begin:end].copy_(self._features[begin:end], non_blocking=True)
            self.features[used:].zero_()
            self._context_control.copy_(self._table(table))
            self.context_control.copy_(self._context_control, non_blocking=True)
            if self._staged is not None:
                self._staged.record()
            self.context_step()
            pending = later

    @torch.inference_mode()
    def propose_batch(self, items: list[tuple[FastDraftState, int, int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """As DFlashDrafter.propose for each (state, last_token, block_size): (ids [block_size-1], logits
        [block_size-1, vocab]) per item, the logits in the drafter's dtype (the reference's float32 logits are these
        values cast: the drafts are their argmax either way). The blocks share block steps of R rows, up to S per step, a
        sequence at most once per step; the last step's logits view a buffer the next proposal reuses. The
        states are not changed."""
        results: list = [None] * len(items)
        order = list(range(len(items)))
        views: list[int] = []
        while order:
            table, tokens, later, step = [], [], [], []
            for index in order:
                state, last_token, block_size = items[index]
                if len(table) == self.max_segments or any(s[segments.SLOT] == state.slot for s in table):
                    later.append(index)
                    continue
                table.append(segments.segment(state.slot, block_size, state.length, first=len(tokens)))
                tokens.extend([last_token] + [self.config.mask_token_id] * (block_size - 1))
                step.append(index)
            for index in views:  # this step overwrites the logits an earlier step's proposals view
                ids, logits = results[index]
                results[index] = ids, logits.clone()
            # (the pinned buffers are free: the last block step's copies were waited for with its ids; a context
            # step still running on the device goes on while these are filled)
            self._tokens[:len(tokens)].copy_(torch.tensor(tokens, dtype=torch.long))
            self._tokens[len(tokens):].fill_(self.config.mask_token_id)
            self._control.copy_(self._table(table))
            self.tokens.copy_(self._tokens, non_blocking=True)
            self.control.copy_(self._control, non_blocking=True)
            self.block_step()
            self._ids.copy_(self.ids, non_blocking=True)
            if self.ids.is_cuda:
                torch.cuda.current_stream().synchronize()
            for index, segment in zip(step, table):
                mask_rows = slice(segment[segments.FIRST] + 1, segment[segments.FIRST] + segment[segments.ROWS])
                results[index] = self._ids[mask_rows].clone(), self.logits[mask_rows]
            views, order = step, later
        return results

    # ---- the two steps (run eagerly or captured) ---------------------------------------------------

    def _context_step(self) -> None:
        c, ref = self.config, self.reference
        eps = c.rms_norm_eps
        self.context.copy_(F.linear(self.features, ref.fc))
        elementwise.add_rms_norm(self.context, ref.hidden_norm, eps, out=self.context_normed, zero_centred=False)
        for layer, keys, values in zip(self.layers, self.keys, self.values):
            attention_kernels.append_kv(
                F.linear(self.context_normed, layer.kv), layer.k_norm, self.cos, self.sin, keys, values,
                self.key_scratch, self.context_control, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                rotary_dim=c.head_dim, eps=eps, rows=self.batch_rows, zero_centred=False,
                segments=self.max_segments,
            )

    def _block_step(self) -> None:
        c, ref = self.config, self.reference
        eps = c.rms_norm_eps
        self.hidden.copy_(F.embedding(self.tokens, ref.embed_tokens))
        delta = None  # the last branch's output, added to the residual stream by the next norm
        for layer, keys, values in zip(self.layers, self.keys, self.values):
            self._add_norm(delta, layer.input_layernorm)
            attention_kernels.attention_step(
                F.linear(self.normed, layer.qkv), layer.q_norm, layer.k_norm, self.cos, self.sin, keys, values,
                self.query, self.partials, self.attn_out, self.control,
                num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                rotary_dim=c.head_dim, eps=eps, rows=self.batch_rows, segments=self.max_segments,
                segment_rows=self.rows, gated=False, zero_centred=False, causal=layer.window > 0,
                window=layer.window,
            )
            delta = F.linear(self.attn_out, layer.o_proj)
            self._add_norm(delta, layer.post_attention_layernorm)
            delta = F.linear(elementwise.silu_mul(F.linear(self.normed, layer.gate_up), self.act), layer.down)
        self._add_norm(delta, ref.norm)
        # every row's logits (a block's first row holds its last committed token: its logits go unread); the argmax
        # of the head's own output is the reference's argmax of it cast to float32 (the cast is exact)
        self.logits = F.linear(self.normed, ref.lm_head)  # captured: the graph's output, rewritten by each replay
        torch.argmax(self.logits, dim=-1, out=self.ids)

    def _add_norm(self, delta, weight) -> None:
        elementwise.residual_rms_norm(self.hidden, delta, weight, self.config.rms_norm_eps, self.normed,
                                      zero_centred=False)
