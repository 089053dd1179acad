"""`FastShard`: a shard served through the fixed-shape step (shardd/fast/step.py), in place of a ShardModel.

Same contract as ShardModel (forward, new_state, rollback through the state's storage, snapshot/restore):
a daemon serves either. Inputs of at most T rows go through the step; longer ones (prefill, the re-fill
of a prompt) through the reference model's chunked path, over the same pooled state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from protocol.layout import CHECKPOINT, REPLAY_SSM
from protocol.timing import DAEMON as PHASES
from shardd.fast import prefill
from shardd.fast.graph import StepRunner
from shardd.fast.pools import StatePools
from shardd.fast.step import StepBuffers
from shardd.fast.weights import fuse_layers
from shardd.kernels import gdn as gdn_kernels
from shardd.model import rollback as rb
from shardd.model.shard import ShardModel, ShardOutput
from shardd.model.state import PendingStep, SequenceState

DEFAULT_ROWS = 16  # T of a shard without rollback storage


class FastShard:
    engine = "fast"
    def __init__(self, model: ShardModel, *, max_sequences: int, max_context: int, use_graphs: bool | None = None,
                 storage: rb.RollbackStorage | None = None, layers=None):
        """`storage` and `layers` let a second FastShard share a model and its fused weights with another
        rollback mode (benchmarks compare modes on one copy of the weights)."""
        self.model = model
        if model.device.type == "cuda" and model.device.index is not None:  # graphs, streams and Triton launch
            torch.cuda.set_device(model.device)                              # on the current device
        self.storage = storage = storage or model.storage
        if storage.max_verify_tokens != model.storage.max_verify_tokens:
            raise ValueError("a shared model validates steps against its own max_verify_tokens")
        self.rows = storage.max_verify_tokens if storage.enabled else DEFAULT_ROWS
        self.layers = layers if layers is not None else fuse_layers(model)
        self.pools = StatePools(
            model.config, model.attention_layers, model.gdn_layers, sequences=max_sequences, max_context=max_context,
            rows=self.rows, storage=storage, dtype=model.dtype, device=model.device,
        )
        self.buffers = StepBuffers(model, self.rows, max_context)
        if use_graphs is None:
            use_graphs = model.device.type == "cuda"
        self.runner = StepRunner(model, self.layers, self.pools, self.buffers, use_graphs=use_graphs)
        self.prefill_kernels = prefill.available(model.device)
        pin = model.device.type == "cuda"
        self._control = torch.zeros(6, dtype=torch.int32, pin_memory=pin)
        self._tokens = torch.zeros(self.rows, dtype=torch.long, pin_memory=pin)
        self._hidden = torch.zeros((self.rows, model.config.hidden_size), dtype=model.dtype, pin_memory=pin)
        self._ids = torch.zeros(self.rows, dtype=torch.long, pin_memory=pin)

    def sharing_weights(self, storage: rb.RollbackStorage, *, max_sequences: int | None = None,
                        max_context: int | None = None) -> "FastShard":
        """Another FastShard over the same model and fused weights, with pools of its own."""
        return FastShard(self.model, max_sequences=max_sequences or self.pools.scratch_slot,
                         max_context=max_context or self.pools.max_context, use_graphs=self.runner.use_graphs,
                         storage=storage, layers=self.layers)

    @property
    def step_rows(self) -> int:
        return self.rows

    # everything else a daemon reads of its shard (config, layer range, dtype, ...) is the model's
    def __getattr__(self, name):
        return getattr(self.model, name)

    # ---- sequences -------------------------------------------------------------------------------

    def new_state(self, max_context: int) -> SequenceState:
        if max_context > self.pools.max_context:
            raise ValueError(f"this shard's slots hold {self.pools.max_context} tokens, asked for {max_context}")
        return self.pools.acquire()

    def release_state(self, state: SequenceState) -> None:
        self.pools.release(state)

    def checkpoint_bytes_per_sequence(self) -> int:
        return rb.storage_bytes_per_sequence(self.model.config, self.model.gdn_layers, self.storage)

    # ---- forward ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, state: SequenceState, pos: int, *, tokens=None, hidden=None, checkpoint: bool = False,
                capture_layers=()) -> ShardOutput:
        n = self.model.check_forward(state, pos, tokens=tokens, hidden=hidden, checkpoint=checkpoint)
        if n > self.rows:
            rb.settle(state)  # the reference and prefill paths read the state itself
            if not self.prefill_kernels:
                return self.model.forward(state, pos, tokens=tokens, hidden=hidden, checkpoint=checkpoint,
                                          capture_layers=capture_layers)
            return self._prefill(state, pos, n, tokens, hidden, capture_layers)
        save, n_save = gdn_kernels.SAVE_NOTHING, 0
        if checkpoint and self.pools.mode == CHECKPOINT:
            save, n_save = gdn_kernels.SAVE_WINDOWS, n + 1
        elif checkpoint and self.pools.mode == REPLAY_SSM:
            save, n_save = gdn_kernels.SAVE_LOG, 1
        start = self.pools.start[state.slot]  # after a checkpoint rollback: the kept token's checkpoint slot
        self._control.copy_(torch.tensor([state.slot, n, pos, save, n_save, start], dtype=torch.int32))
        b = self.buffers
        b.control.copy_(self._control, non_blocking=True)
        if self.model.owns_embedding:
            self._tokens.zero_()
            self._tokens[:n] = torch.as_tensor(tokens, dtype=torch.long)
            b.tokens.copy_(self._tokens, non_blocking=True)
        else:  # only the n real rows cross (pinned, queued); the padding rows are zeroed on the device
            self._hidden[:n].copy_(hidden)
            b.hidden_in[:n].copy_(self._hidden[:n], non_blocking=True)
            if n < self.rows:
                b.hidden_in[n:].zero_()

        state.pending = None  # a new step ends the previous pending window
        captured = self.runner.run(tuple(sorted(set(capture_layers))))
        self.pools.start[state.slot] = -1  # the step left the state in the sequence's own buffers
        state.length = pos + n
        if checkpoint:
            state.pending = PendingStep(start=pos, n=n)
        PHASES.lap("launch")

        out = ShardOutput()
        if self.model.owns_head:
            self._ids.copy_(b.ids, non_blocking=True)
            out.logits = b.logits[:n]
            if b.ids.is_cuda:
                torch.cuda.current_stream().synchronize()
            PHASES.lap("wait")
            out.ids = self._ids[:n].clone()
        else:
            self._hidden[:n].copy_(b.hidden[:n], non_blocking=True)
            if b.hidden.is_cuda:
                torch.cuda.current_stream().synchronize()
            PHASES.lap("wait")
            out.hidden = self._hidden[:n].clone()
        out.captured = {layer: buffer[:n].cpu() for layer, buffer in captured.items()}
        PHASES.lap("copy")
        return out

    def _prefill(self, state, pos, n, tokens, hidden, capture_layers) -> ShardOutput:
        model = self.model
        if model.owns_embedding:
            x = F.embedding(torch.tensor(tokens, dtype=torch.long, device=model.device), model.embed_tokens)
        else:
            x = hidden.to(device=model.device, dtype=model.dtype)
        state.pending = None
        out = prefill.prefill(model, self.layers, state, pos, x, capture_layers)
        state.length = pos + n
        return out
