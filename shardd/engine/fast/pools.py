"""Every open sequence's state in pointer-stable slots, so one captured step serves any sequence by index.

A slot holds the KV cache of each attention layer, the conv window and recurrent state of each GDN layer,
the step's recurrence inputs (q, k, v, g, beta: what `gdn_recurrence` reads, and what a replay-ssm
rollback re-runs), and the rollback storage of the shard's mode. A `SequenceState` handed to the daemon is
made of views into its slot, so the reference path (prefill) and the step share one state. The last slot
is scratch for warm-up and graph capture; it never holds a sequence.
"""

from __future__ import annotations

import torch

from common.model_config import ModelConfig
from protocol.layout import CHECKPOINT, REPLAY_SSM
from shardd.engine.kernels import gdn as gdn_kernels
from shardd.engine.kernels import segments
from shardd.engine.reference import rollback as rb
from shardd.engine.reference.state import GDNStates, KVCache, SequenceState


class SlotCheckpoint(rb.CheckpointBuffers):
    """checkpoint mode, one slot: a rollback copies nothing. It leaves the kept token's checkpoint slot as the
    state the slot's next step starts from (`StatePools.start`, control[5]: the step's kernels read the window
    and the recurrent state there); `settle` does the copy for a reader outside the step (prefill, a snapshot)."""

    @classmethod
    def of(cls, pools: "StatePools", slot: int) -> "SlotCheckpoint":
        buffers = cls.over(pools.saved[slot], pools.windows[slot], pools.gdn_layers)
        buffers.pools, buffers.slot = pools, slot
        return buffers

    def restore(self, states: GDNStates, keep: int) -> None:
        self.pools.start[self.slot] = keep

    def settle(self, states: GDNStates) -> None:
        keep = self.pools.start[self.slot]
        if keep >= 0:
            rb.CheckpointBuffers.restore(self, states, keep)
            self.pools.start[self.slot] = -1


class SlotRecurrenceLog:
    """replay-ssm mode, one slot: the state before the step, its conv inputs, and the recurrence inputs the
    step left in the pool. A rollback re-runs the step's own recurrence kernel over the kept tokens: inside the
    slot's next step, on a side stream ahead of each GDN layer (`StatePools.replay`, shardd/engine/fast/step.py), or at
    once for a reader outside the step (`settle`)."""

    def __init__(self, pools: "StatePools", slot: int):
        self.pools, self.slot = pools, slot

    def restore(self, states: GDNStates, keep: int) -> None:
        pools, slot = self.pools, self.slot
        if keep:  # the re-run waits for the slot's next step (or a settle): no device work here but the window
            pools.replay[slot] = keep
        else:
            states.recurrent.copy_(pools.recurrent0[slot, :, 0])
        # the conv window after `keep` tokens: the last `width` rows of (the window before the step, its kept inputs)
        width = pools.conv0.shape[-2]
        if keep >= width:
            states.conv.copy_(pools.conv_inputs[slot, :, keep - width : keep])
        else:
            states.conv[:, : width - keep].copy_(pools.conv0[slot, :, keep:])
            states.conv[:, width - keep :].copy_(pools.conv_inputs[slot, :, :keep])

    def settle(self, states: GDNStates) -> None:
        """The re-run a rollback left for the next step, now: the recurrence kernel reads the saved state and
        leaves the state after `keep` tokens, its control this (slot, keep)'s row of a table written once on the
        device (a control copied per rollback cost a pinned buffer and a copy each)."""
        pools, slot = self.pools, self.slot
        keep = pools.replay[slot]
        if keep:
            gdn_kernels.gdn_recurrence(
                pools.recurrence_inputs, pools.recurrent, pools.recurrent0, pools.replay_out,
                pools.replay_controls[slot, keep], layer0=0, layers=len(pools.gdn_layers), rows=pools.rows,
                num_k_heads=pools.config.linear_num_key_heads, initial=pools.recurrent0,
            )
            pools.replay[slot] = 0

    def nbytes(self) -> int:
        p, s = self.pools, self.slot
        return sum(t[s].nbytes for t in (p.recurrent0, p.conv0, p.conv_inputs, *p.recurrence_inputs))


class StatePools:
    """`rows`: the most rows one sequence brings to a step (its segment's tile: the recurrence inputs and the
    checkpoint slots are per sequence); a step of R rows holds several sequences' segments."""

    def __init__(self, config: ModelConfig, attention_layers: list[int], gdn_layers: list[int], *, sequences: int,
                 max_context: int, rows: int, storage: rb.RollbackStorage, dtype: torch.dtype, device: torch.device):
        c = config
        self.config, self.rows, self.storage = c, rows, storage
        self.max_context = max_context
        self.attention_layers, self.gdn_layers = list(attention_layers), list(gdn_layers)
        slots = sequences + 1
        self.scratch_slot = sequences
        self.free = list(range(sequences))
        act = dict(dtype=dtype, device=device)
        f32 = dict(dtype=torch.float32, device=device)
        kv_shape = (slots, c.num_key_value_heads, max_context, c.head_dim)
        self.keys = {i: torch.zeros(kv_shape, **act) for i in attention_layers}
        self.values = {i: torch.zeros(kv_shape, **act) for i in attention_layers}
        layers, heads = len(gdn_layers), c.linear_num_value_heads
        k_dim, v_dim, k_heads = c.linear_key_head_dim, c.linear_value_head_dim, c.linear_num_key_heads
        width, conv_dim = c.linear_conv_kernel_dim - 1, c.linear_conv_dim
        self.conv = torch.zeros((slots, layers, width, conv_dim), **f32)
        self.recurrent = torch.zeros((slots, layers, heads, k_dim, v_dim), **f32)
        # q, k, v, g, beta of the last step, per layer
        self.recurrence_inputs = (
            torch.zeros((slots, layers, rows, k_heads, k_dim), **f32),
            torch.zeros((slots, layers, rows, k_heads, k_dim), **f32),
            torch.zeros((slots, layers, rows, heads, v_dim), **f32),
            torch.zeros((slots, layers, rows, heads), **f32),
            torch.zeros((slots, layers, rows, heads), **f32),
        )
        # stand-ins for the storage a mode lacks: the kernels take a pointer but never touch it
        self.none = torch.zeros(1, **f32)
        self.windows = self.conv0 = self.conv_inputs = self.none
        self.saved = torch.zeros((1, 1, 1, 1, 1, 1), **f32)
        mode = storage.mode if storage.enabled else None
        if mode == CHECKPOINT:
            self.saved = torch.zeros((slots, layers, rows + 1, heads, k_dim, v_dim), **f32)
            self.windows = torch.zeros((slots, layers, rows + 1, width, conv_dim), **f32)
        elif mode == REPLAY_SSM:
            self.recurrent0 = torch.zeros((slots, layers, 1, heads, k_dim, v_dim), **f32)
            self.saved = self.recurrent0
            self.conv0 = torch.zeros((slots, layers, width, conv_dim), **f32)
            self.conv_inputs = torch.zeros((slots, layers, rows, conv_dim), **f32)
            self.replay_out = torch.zeros((max(layers, 1), rows, heads, v_dim), **f32)
            # the control of a rollback's re-run, per (slot, keep): one segment of `keep` rows from position 0
            self.replay_controls = torch.tensor(
                [[segments.segment(slot, keep, 0) for keep in range(rows + 1)] for slot in range(slots)],
                dtype=torch.int32, device=device)
        self.mode = mode
        # per slot, the checkpoint slot its next step starts from after a checkpoint rollback (-1: its own state)
        self.start = [-1] * slots
        # per slot, the tokens a replay-ssm rollback kept, whose recurrence its next step re-runs first (0: none)
        self.replay = [0] * slots

    # ---- slots -------------------------------------------------------------------------------------

    def acquire(self) -> SequenceState:
        if not self.free:
            raise MemoryError(f"all {self.scratch_slot} sequence slots of this shard are in use")
        slot = self.free.pop(0)
        return self.state_of(slot)

    def release(self, state: SequenceState) -> None:
        if state.slot is not None and state.slot not in self.free and state.slot != self.scratch_slot:
            self.free.append(state.slot)
            self.free.sort()
            state.slot = None

    def state_of(self, slot: int) -> SequenceState:
        kv = {i: KVCache(self.keys[i][slot], self.values[i][slot]) for i in self.attention_layers}
        gdn = GDNStates(self.gdn_layers, self.conv[slot], self.recurrent[slot])
        gdn.conv.zero_()
        gdn.recurrent.zero_()
        self.start[slot] = -1
        self.replay[slot] = 0
        storage = None
        if self.gdn_layers and self.mode == CHECKPOINT:
            storage = SlotCheckpoint.of(self, slot)
        elif self.gdn_layers and self.mode == REPLAY_SSM:
            storage = SlotRecurrenceLog(self, slot)
        return SequenceState(max_context=self.max_context, kv=kv, gdn=gdn, rollback_storage=storage, slot=slot)

    def layer_views(self, row: int) -> dict:
        """What the step's GDN kernels take for GDN layer `row` (its index among the shard's GDN layers)."""
        checkpoint, replay_ssm = self.mode == CHECKPOINT, self.mode == REPLAY_SSM
        return {
            "conv_state": self.conv[:, row],
            "windows": self.windows[:, row] if checkpoint else self.none,
            "log_conv0": self.conv0[:, row] if replay_ssm else self.none,
            "log_in": self.conv_inputs[:, row] if replay_ssm else self.none,
            "rin": tuple(t[:, row] for t in self.recurrence_inputs),
        }
