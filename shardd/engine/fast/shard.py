"""`FastShard`: the fast engine of shardd.engine.interface.ShardEngine (ShardModel is the reference one), a shard served
through the fixed-shape step (shardd/engine/fast/step.py).

Inputs of at most T rows go through the step; longer ones (prefill, the re-fill of a prompt) through the GPU
prefill or the reference model's chunked path, over the same pooled state. `forward_batch` packs several
sequences' inputs into one step of R >= T rows; `forward` is a batch of one. Rollback is per sequence: each slot
keeps its own checkpoint storage and pending window, so a sequence's step never ends another's pending window.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from protocol.layout import CHECKPOINT, REPLAY_SSM
from protocol.timing import DAEMON as PHASES
from common.sizes import PREFILL_ROWS
from shardd.engine.fast import prefill
from shardd.engine.fast.graph import PrefillGraphs, StepRunner
from shardd.engine.fast.pools import StatePools
from shardd.engine.fast.step import StepBuffers
from shardd.engine.fast.weights import fuse_layers
from shardd.obs import timeline
from shardd.engine.batch import BatchItem
from shardd.engine.kernels import gdn as gdn_kernels
from shardd.engine.kernels import segments
from shardd.engine.reference import rollback as rb
from shardd.engine.reference.errors import BadInput, ModelError
from shardd.engine.reference.shard import ShardModel, ShardOutput
from shardd.engine.reference.state import PendingStep, SequenceState

DEFAULT_ROWS = 16  # T of a shard without rollback storage


def _joined(outs: list[ShardOutput]) -> ShardOutput:
    """The pieces' outputs of one prefill, as one output over all its rows."""
    def cat(parts: list) -> torch.Tensor | None:
        return None if parts[0] is None else torch.cat(parts)

    out = ShardOutput()
    out.logits, out.ids = cat([o.logits for o in outs]), cat([o.ids for o in outs])
    out.hidden = cat([o.hidden for o in outs])
    out.captured = {layer: torch.cat([o.captured[layer] for o in outs]) for layer in outs[0].captured}
    return out


class FastShard:
    engine = "fast"
    supports_device_rows = True

    def __init__(self, model: ShardModel, *, max_sequences: int, max_context: int, use_graphs: bool | None = None,
                 storage: rb.RollbackStorage | None = None, layers=None, step_rows: int | None = None,
                 prefill_rows: int = PREFILL_ROWS):
        """`step_rows` (R): the rows of one step, shared by the sequences of a batch (default: one sequence's
        most, `max_verify_tokens`); it must hold one sequence's most. `prefill_rows` (P): on the GPU prefill
        path an input goes in pieces of P rows, each piece of exactly P rows replayed from CUDA graphs (0: one
        eager call, as before). `storage` and `layers` let a second FastShard share a model and its fused
        weights with another rollback mode (benchmarks compare modes on one copy of the weights)."""
        self.model = model
        # what a daemon reads of its engine: the model's
        self.config, self.fingerprint = model.config, model.fingerprint
        self.begin, self.end, self.dtype, self.device = model.begin, model.end, model.dtype, model.device
        self.owns_embedding, self.owns_head = model.owns_embedding, model.owns_head
        self.gdn_layers, self.attention_layers = model.gdn_layers, model.attention_layers
        if model.device.type == "cuda" and model.device.index is not None:  # graphs, streams and Triton launch
            torch.cuda.set_device(model.device)                              # on the current device
        self.storage = storage = storage or model.storage
        if storage.max_verify_tokens != model.storage.max_verify_tokens:
            raise ValueError("a shared model validates steps against its own max_verify_tokens")
        # T: the most rows one sequence brings to a step (a verify block; longer inputs take the prefill path)
        self.rows = storage.max_verify_tokens if storage.enabled else DEFAULT_ROWS
        self.batch_rows = self.rows if step_rows is None else step_rows  # R: the rows of every step
        if self.batch_rows < self.rows:
            raise ValueError(f"step_rows={self.batch_rows} must hold one sequence's step of {self.rows} rows "
                             "(max_verify_tokens)")
        self.max_segments = min(max_sequences, self.batch_rows)  # sequences one step holds
        self.layers = layers if layers is not None else fuse_layers(model)
        self.pools = StatePools(
            model.config, model.attention_layers, model.gdn_layers, sequences=max_sequences, max_context=max_context,
            rows=self.rows, storage=storage, dtype=model.dtype, device=model.device,
        )
        self.buffers = StepBuffers(model, self.batch_rows, max_context, segments=self.max_segments,
                                   segment_rows=self.rows)
        if use_graphs is None:
            use_graphs = model.device.type == "cuda"
        self.runner = StepRunner(model, self.layers, self.pools, self.buffers, use_graphs=use_graphs)
        self.prefill_kernels = prefill.available(model.device)
        if prefill_rows < 0:
            raise ValueError(f"prefill_rows must be >= 0, got {prefill_rows}")
        self.prefill_rows = prefill_rows if self.prefill_kernels and prefill_rows <= max_context else 0
        self.prefill_graphs = PrefillGraphs(model, self.layers, self.pools, self.prefill_rows,
                                            use_graphs=use_graphs) if self.prefill_rows else None
        pin = model.device.type == "cuda"
        self._control = torch.zeros(segments.size(self.max_segments, self.batch_rows), dtype=torch.int32, pin_memory=pin)
        self._tokens = torch.zeros(self.batch_rows, dtype=torch.long, pin_memory=pin)
        self._hidden = torch.zeros((self.batch_rows, model.config.hidden_size), dtype=model.dtype, pin_memory=pin)
        self._ids = torch.zeros(self.batch_rows, dtype=torch.long, pin_memory=pin)
        self._replay_control = torch.zeros(segments.size(self.max_segments, 0), dtype=torch.int32, pin_memory=pin)
        # a non-head step's output rows stay on the device (copied out of the step's buffer there, not waited
        # for) instead of landing in host memory: set by a daemon whose rows go on through the next shard's
        # device ring (shardd/server/ring.py); whoever reads them on the host waits for the device then
        self.rows_out_on_device = False
        # the host writes the next step's control, tokens and rows into the pinned buffers above only once the
        # device has read the last step's (a step that does not wait for its outputs leaves them in flight)
        self._staged = torch.cuda.Event() if pin else None

    def sharing_weights(self, storage: rb.RollbackStorage, *, max_sequences: int | None = None,
                        max_context: int | None = None) -> "FastShard":
        """Another FastShard over the same model and fused weights, with pools of its own."""
        return FastShard(self.model, max_sequences=max_sequences or self.pools.scratch_slot,
                         max_context=max_context or self.pools.max_context, use_graphs=self.runner.use_graphs,
                         storage=storage, layers=self.layers,
                         step_rows=self.batch_rows if self.batch_rows != self.rows else None,
                         prefill_rows=self.prefill_rows)

    @property
    def step_rows(self) -> int:
        """The most rows of one sequence that take the fixed step (HELLO's `step_rows`); `batch_rows` is the
        step's R, shared by the sequences of a batch."""
        return self.rows

    def weight_bytes(self) -> int:
        return self.model.weight_bytes()

    def state_bytes_per_sequence(self, max_context: int) -> int:
        return self.model.state_bytes_per_sequence(max_context)

    # ---- sequences -------------------------------------------------------------------------------

    def new_state(self, max_context: int) -> SequenceState:
        if max_context > self.pools.max_context:
            raise ValueError(f"this shard's slots hold {self.pools.max_context} tokens, asked for {max_context}")
        return self.pools.acquire()

    def release_state(self, state: SequenceState) -> None:
        self.pools.release(state)

    def checkpoint_bytes_per_sequence(self) -> int:
        return rb.storage_bytes_per_sequence(self.model.config, self.model.gdn_layers, self.storage)

    def check_rollback_storage(self, n: int = 0) -> None:
        self.model.check_rollback_storage(n)

    # ---- rollback: the slot storage's (shardd/engine/fast/pools.py) ----------------------------------------

    def rollback(self, state: SequenceState, keep: int) -> None:
        """A checkpoint rollback points the slot's next step at the kept token's checkpoint slot; a replay-ssm
        one leaves the kept tokens' re-run to that step: `settle` does either's work now."""
        rb.rollback(state, keep)

    def settle(self, state: SequenceState) -> None:
        if state.rollback_storage is not None:
            state.rollback_storage.settle(state.gdn)

    def describe(self) -> dict:
        """`prefill_graphs` (with a graphed prefill): its piece's rows, the captured-layer sets whose graphs replay,
        and those that run eagerly with the reason (a capture that failed, or graphs that differed from the eager
        path on their first call)."""
        return {} if self.prefill_graphs is None else {"prefill_graphs": self.prefill_graphs.describe()}

    def snapshot(self, state: SequenceState) -> None:
        self.settle(state)
        rb.snapshot(state)

    def restore(self, state: SequenceState) -> None:
        if state.snapshot is not None:  # the restored state is the sequence's own: no step starts from a slot
            self.settle(state)
        rb.restore(state)

    # ---- forward ---------------------------------------------------------------------------------

    def check_forward(self, state: SequenceState, pos: int, *, tokens=None, hidden=None,
                      checkpoint: bool = False) -> int:
        return self.model.check_forward(state, pos, tokens=tokens, hidden=hidden, checkpoint=checkpoint)

    @torch.inference_mode()
    def forward(self, state: SequenceState, pos: int, *, tokens=None, hidden=None, checkpoint: bool = False,
                capture_layers=()) -> ShardOutput:
        """One sequence: a batch of one (the same code path as `forward_batch`)."""
        item = BatchItem(state, pos, tokens=tokens, hidden=hidden, checkpoint=checkpoint,
                         capture_layers=tuple(capture_layers))
        [out] = self.forward_batch([item])
        if isinstance(out, ModelError):
            raise out
        return out

    @torch.inference_mode()
    def forward_batch(self, items: Sequence[BatchItem]) -> list[ShardOutput | ModelError]:
        """Per item its ShardOutput, or the ModelError that refused it (its sequence unchanged; the others run).

        Items of at most `step_rows` rows share fixed-shape steps of `batch_rows` rows, in order, each sequence's
        rows contiguous; a step holds a sequence once (a second item of it starts the next step, validated
        against what the first left). Longer items (a prompt) take the prefill path one by one. The head
        shard's logits of the items of the last step view its buffer (valid until the next call)."""
        results: list[ShardOutput | ModelError | None] = [None] * len(items)
        step: list[tuple[int, BatchItem, int]] = []  # (index, item, n)
        views: list[ShardOutput] = []  # outputs of this call whose logits view the step's buffer
        used, in_step = 0, set()  # rows taken, ids of the states in `step`
        for index, item in enumerate(items):
            if id(item.state) in in_step:
                self._run_step(step, results, views)
                step, used, in_step = [], 0, set()
            try:
                if item.state.slot is None:
                    raise BadInput("the sequence has no state slot on this shard (closed)")
                n = self.model.check_forward(item.state, item.pos, tokens=item.tokens, hidden=item.hidden,
                                             checkpoint=item.checkpoint)
            except ModelError as error:
                results[index] = error
                continue
            if n > self.rows:
                results[index] = self._forward_long(item, n)
                continue
            if used + n > self.batch_rows or len(step) == self.max_segments:
                self._run_step(step, results, views)
                step, used, in_step = [], 0, set()
            step.append((index, item, n))
            in_step.add(id(item.state))
            used += n
        self._run_step(step, results, views)
        return results

    def _forward_long(self, item: BatchItem, n: int) -> ShardOutput:
        """An input longer than a step's segment (a prompt, a re-fill): the prefill path, over the same pooled state."""
        state = item.state
        self.settle(state)  # the reference and prefill paths read the state itself
        if not self.prefill_kernels:
            return self.model.forward(state, item.pos, tokens=item.tokens, hidden=item.hidden,
                                      checkpoint=item.checkpoint, capture_layers=item.capture_layers)
        return self._prefill(state, item.pos, n, item.tokens, item.hidden, item.capture_layers)

    def _run_step(self, step: list[tuple[int, BatchItem, int]], results: list, views: list[ShardOutput]) -> None:
        """One fixed-shape step over the validated items of `step`, their rows packed from row 0."""
        if not step:
            return
        for out in views:  # this step overwrites the logits buffer an earlier step's outputs view
            out.logits = out.logits.clone()
        views.clear()
        b, pools = self.buffers, self.pools
        if self._staged is not None:
            self._staged.synchronize()  # at once in a step-by-step exchange (the last step's copies are long done)
        table, tokens, first = [], [], 0
        # input rows from the host go through the pinned staging buffer; rows already on the device (a previous
        # shard's, out of this shard's device ring) straight into the step's input buffer
        rows_in = RowSpans(self._hidden) if not self.model.owns_embedding else None
        rows_on_device = RowSpans(b.hidden_in) if not self.model.owns_embedding else None
        host_spans: list[tuple[int, int]] = []
        device_rows: list[tuple[int, torch.Tensor]] = []  # (first row, rows) already on the device
        for _, item, n in step:
            save, n_save = gdn_kernels.SAVE_NOTHING, 0
            if item.checkpoint and pools.mode == CHECKPOINT:
                save, n_save = gdn_kernels.SAVE_WINDOWS, n + 1
            elif item.checkpoint and pools.mode == REPLAY_SSM:
                save, n_save = gdn_kernels.SAVE_LOG, 1
            slot = item.state.slot
            # after a checkpoint rollback the step starts from the kept token's checkpoint slot
            table.append(segments.segment(slot, n, item.pos, save=save, n_save=n_save, start=pools.start[slot],
                                          first=first))
            if self.model.owns_embedding:
                tokens.extend(item.tokens)
            elif item.hidden.is_cuda and b.hidden_in.is_cuda:
                device_rows.append((first, item.hidden))
            else:
                rows_in.add(first, item.hidden)
                host_spans.append((first, n))
            first += n
        if rows_in is not None:
            rows_in.flush()
        used = first
        if self.model.owns_embedding:  # the padding rows embed token 0
            self._tokens.copy_(torch.tensor(tokens + [0] * (self.batch_rows - used), dtype=torch.long))
        self._control.copy_(torch.tensor(segments.table(table, self.max_segments, pools.scratch_slot, self.batch_rows),
                                         dtype=torch.int32))
        b.control.copy_(self._control, non_blocking=True)
        if pools.mode == REPLAY_SSM:  # each segment's pending re-run (a rollback's kept tokens) runs in this step
            replays = [segments.segment(item.state.slot, pools.replay[item.state.slot], 0, first=index * self.rows)
                       for index, (_, item, _) in enumerate(step)]
            self._replay_control.copy_(torch.tensor(segments.padded(replays, self.max_segments, pools.scratch_slot),
                                                    dtype=torch.int32))
            b.replay_control.copy_(self._replay_control, non_blocking=True)
            b.replays_pending = any(replay[segments.ROWS] for replay in replays)
        if self.model.owns_embedding:
            b.tokens.copy_(self._tokens, non_blocking=True)
        else:  # only the real rows cross (pinned, queued); the padding rows are zeroed on the device
            if len(host_spans) == len(step):
                b.hidden_in[:used].copy_(self._hidden[:used], non_blocking=True)
            else:  # some rows came on the device: the host ones span by span
                for start, n in host_spans:
                    b.hidden_in[start:start + n].copy_(self._hidden[start:start + n], non_blocking=True)
            if used < self.batch_rows:
                b.hidden_in[used:].zero_()
        if self._staged is not None:  # the copies out of the pinned staging buffers are queued
            self._staged.record()
        if device_rows:
            for start, rows in device_rows:
                rows_on_device.add(start, rows)
            rows_on_device.flush()
        if pools.mode == REPLAY_SSM:  # their pending re-runs are in this step's control now
            for _, item, _ in step:
                pools.replay[item.state.slot] = 0

        for _, item, _ in step:
            item.state.pending = None  # a new step ends the sequence's previous pending window
        capture = tuple(sorted({layer for _, item, _ in step for layer in item.capture_layers}))
        timeline.gpu("step start")
        captured = self.runner.run(capture)
        timeline.gpu("step end")
        for _, item, n in step:
            state = item.state
            pools.start[state.slot] = -1  # the step left the state in the sequence's own buffers
            state.length = item.pos + n
            if item.checkpoint:
                state.pending = PendingStep(start=item.pos, n=n)
        PHASES.lap("launch")

        on_device = self.rows_out_on_device and not self.model.owns_head and b.hidden.is_cuda
        if self.model.owns_head:
            self._ids[:used].copy_(b.ids[:used], non_blocking=True)
        elif not on_device:
            self._hidden[:used].copy_(b.hidden[:used], non_blocking=True)
        # the captured layers' rows, one copy per layer for the whole step (the next step reuses the buffers): on
        # the device where the step's rows stay there (they go on beside them through the next shard's ring) and on
        # the head (a drafter beside it reads them there), as a prefill's; else to the host behind the step's wait
        keep = (lambda rows: rows.clone()) if on_device or self.model.owns_head else to_host
        kept = {layer: keep(rows[:used]) for layer, rows in captured.items()}
        if b.ids.is_cuda and not on_device:
            torch.cuda.current_stream().synchronize()
        PHASES.lap("wait")
        # one copy of the step's outputs; each item views its own rows
        ids = self._ids[:used].clone() if self.model.owns_head else None
        hidden = None if self.model.owns_head else (b.hidden if on_device else self._hidden)[:used].clone()
        first = 0
        for index, item, n in step:
            rows = slice(first, first + n)
            out = ShardOutput()
            if self.model.owns_head:
                out.ids = ids[rows]
                if item.logits:  # an item that only wants its ids never keeps (nor has cloned) the buffer's rows
                    out.logits = b.logits[rows]
                    views.append(out)
            else:
                out.hidden = hidden[rows]
            out.captured = {layer: kept[layer][rows] for layer in sorted(set(item.capture_layers))}
            results[index] = out
            first += n
        PHASES.lap("copy")

    def _prefill(self, state, pos, n, tokens, hidden, capture_layers) -> ShardOutput:
        """In pieces of `prefill_rows` from `pos` (a rule of the shard, graphs or not, so the same input always
        rounds the same way); a piece of exactly that many rows replays the prefill graphs."""
        model = self.model
        if model.owns_embedding:
            x = F.embedding(torch.tensor(tokens, dtype=torch.long, device=model.device), model.embed_tokens)
        else:
            x = hidden.to(device=model.device, dtype=model.dtype)
        state.pending = None
        size = self.prefill_rows or n
        outs = []
        for first in range(0, n, size):
            piece, at = x[first:first + size], pos + first

            def eager(piece=piece, at=at):
                return prefill.prefill(model, self.layers, state, at, piece, capture_layers)

            if piece.shape[0] == self.prefill_rows:
                outs.append(self.prefill_graphs.run(state, at, piece, capture_layers, eager))
            else:
                outs.append(eager())
        state.length = pos + n
        return outs[0] if len(outs) == 1 else _joined(outs)


class RowSpans:
    """The items' input rows into the step's host buffer, in order: consecutive items whose rows lie end to end in
    one tensor (a batch's hidden frame, each item a view of its rows; the rows of a previous shard's step) go as
    one copy instead of one per item."""

    def __init__(self, dest: torch.Tensor) -> None:
        self.dest = dest
        self.run: tuple | None = None  # (first row in dest, root tensor, element offset in it, rows)

    def add(self, first: int, rows: torch.Tensor) -> None:
        root = rows._base
        if root is None or root.dtype != rows.dtype or not rows.is_contiguous() or not root.is_contiguous():
            self.flush()
            self.dest[first:first + rows.shape[0]].copy_(rows)
            return
        offset = (rows.data_ptr() - root.data_ptr()) // rows.element_size()
        if self.run is not None:
            run_first, run_root, run_offset, n = self.run
            if run_root is root and first == run_first + n and offset == run_offset + n * self.dest.shape[1]:
                self.run = (run_first, root, run_offset, n + rows.shape[0])
                return
            self.flush()
        self.run = (first, root, offset, rows.shape[0])

    def flush(self) -> None:
        if self.run is not None:
            first, root, offset, n = self.run
            width = self.dest.shape[1]
            self.dest[first:first + n].copy_(root.view(-1)[offset:offset + n * width].view(n, width))
            self.run = None


def to_host(rows: torch.Tensor) -> torch.Tensor:
    """A copy of `rows` in host memory: pinned and not waited for on a GPU (the caller's wait covers it), a plain
    copy on the CPU."""
    if not rows.is_cuda:
        return rows.clone()
    host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
    host.copy_(rows, non_blocking=True)
    return host
