"""The step and the prefill as CUDA graphs: each runner owns its static buffers and one set of graphs per set of
captured layers, as vLLM's and SGLang's graph runners do, so the model code never learns that graphs exist."""

from __future__ import annotations

import logging

import torch

from shardd.engine.fast import prefill
from shardd.engine.fast.step import StepBuffers, run_step
from shardd.engine.fast.weights import FusedLayer
from shardd.engine.kernels import segments
from shardd.engine.reference.shard import ShardModel, ShardOutput
from shardd.engine.reference.state import GDNStates, SequenceState

log = logging.getLogger("shardd")


class StepRunner:
    """Runs the step for a given set of captured layers: replays its CUDA graph, captured on first use
    (with `use_graphs`), or runs it eagerly (CPU, TRITON_INTERPRET=1 tests)."""

    def __init__(self, model, layers, pools, buffers: StepBuffers, *, use_graphs: bool):
        self.model, self.layers, self.pools, self.buffers = model, layers, pools, buffers
        self.use_graphs = use_graphs
        self.graphs: dict[tuple[int, ...], tuple[torch.cuda.CUDAGraph, dict[int, torch.Tensor]]] = {}
        self.capture_outputs: dict[tuple[int, ...], dict[int, torch.Tensor]] = {}
        self.memory_pool = torch.cuda.graph_pool_handle() if use_graphs else None

    def outputs(self, capture: tuple[int, ...]) -> dict[int, torch.Tensor]:
        if capture not in self.capture_outputs:
            b = self.buffers
            self.capture_outputs[capture] = {layer: torch.zeros_like(b.hidden) for layer in capture}
        return self.capture_outputs[capture]

    def run(self, capture: tuple[int, ...] = ()) -> dict[int, torch.Tensor]:
        captured = self.outputs(capture)
        if not self.use_graphs:
            run_step(self.model, self.layers, self.pools, self.buffers, captured)
            return captured
        if capture not in self.graphs:
            self.graphs[capture] = self._capture(captured)
        self.graphs[capture].replay()
        return captured

    def _capture(self, captured) -> torch.cuda.CUDAGraph:
        """Warm up (compiles the kernels, creates cuBLAS handles) and capture, both on the scratch slot, so no
        sequence's state is touched; the real control is put back afterwards."""
        b = self.buffers
        control, replays = b.control.clone(), b.replay_control.clone()
        b.replay_control.zero_()  # no re-run of a real sequence's rollback while warming up
        scratch = self.pools.scratch_slot
        rows = b.tokens.shape[0]
        b.control.copy_(torch.tensor(
            segments.table([segments.segment(scratch, b.segment_rows, 0)], b.segments, scratch, rows), dtype=torch.int32))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                run_step(self.model, self.layers, self.pools, self.buffers, captured)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory_pool):
            run_step(self.model, self.layers, self.pools, self.buffers, captured)
        b.control.copy_(control)
        b.replay_control.copy_(replays)
        return graph


class CapturedCall:
    """A fixed-shape call on static buffers (the DFlash drafter's steps, shardd/engine/fast/draft.py): replays its CUDA
    graph, captured by `capture()` after two warm-up runs on a side stream, or runs eagerly without graphs.
    The caller points the step's control at a scratch slot while it captures, as StepRunner does."""

    def __init__(self, fn, *, use_graphs: bool, pool=None):
        self.fn, self.use_graphs, self.pool = fn, use_graphs, pool
        self.graph: torch.cuda.CUDAGraph | None = None

    def capture(self) -> None:
        if not self.use_graphs or self.graph is not None:
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.fn()
        self.graph = graph

    def __call__(self) -> None:
        if not self.use_graphs:
            self.fn()
            return
        self.capture()
        self.graph.replay()


class PrefillGraphs:
    """The prefill of exactly `rows` tokens with its stages replayed from CUDA graphs (one graph per stage
    between two attention cores, per set of captured layers), so a prompt chunk costs its kernels' time instead
    of its launches' (an eager call is launch-bound up to about a thousand tokens).

    The graphs read and write static buffers and a staging copy of the shard's GDN state: a call copies the
    sequence's state in (two copies) and out (two), so one set of graphs serves every slot and position; the
    attention cores, which depend on the position, run eagerly between the replays on the sequence's own KV
    cache. The first call of a capture set checks the graphs against the eager path on its own input and state
    (outputs, GDN state and the KV rows written, bit for bit) and answers with the eager result: a set whose
    graphs differ, or fail to capture, stays eager, with a warning in the log."""

    def __init__(self, model: ShardModel, layers: list[FusedLayer], pools, rows: int, *, chunk_rule=None,
                 use_graphs: bool = True):
        """`use_graphs` False: each stage replays by running its ops (the CPU test of everything but the capture)."""
        self.model, self.layers, self.pools, self.rows = model, layers, pools, rows
        self.rule = chunk_rule or prefill.fla_rule()
        self.use_graphs = use_graphs
        self.staging: GDNStates | None = None  # allocated with the first capture
        self.sets: dict[tuple[int, ...], tuple | None] = {}  # capture set -> (PrefillPass, stages, graphs), None: eager
        self.memory_pool = None
        self.failures: dict[tuple[int, ...], str] = {}

    def describe(self) -> dict:
        """The piece's rows, the capture sets whose graphs replay, and those that run eagerly with the reason."""
        return {"rows": self.rows,
                "replayed": [list(capture) for capture, entry in self.sets.items() if entry is not None],
                "eager": [{"captured_layers": list(capture), "reason": reason}
                          for capture, reason in self.failures.items()]}

    def run(self, state: SequenceState, pos: int, x: torch.Tensor, capture_layers, eager) -> ShardOutput:
        """x [rows, hidden] at pos; `eager()` runs the same call through `prefill` (on the first call of a
        capture set, and for a set that stays eager)."""
        capture = prefill.captured_layers(self.layers, capture_layers)
        if capture not in self.sets:
            return self._first(capture, state, pos, x, eager)
        entry = self.sets[capture]
        if entry is None:
            return eager()
        self._replay(entry, state, pos, x)
        state.gdn.conv.copy_(self.staging.conv)
        state.gdn.recurrent.copy_(self.staging.recurrent)
        return prefill.pass_output(self.model, entry[0], copy=True)

    def _replay(self, entry, state: SequenceState, pos: int, x: torch.Tensor) -> None:
        run, stages, graphs = entry
        self.staging.conv.copy_(state.gdn.conv)
        self.staging.recurrent.copy_(state.gdn.recurrent)
        run.hidden.copy_(x)
        run.kv, run.pos = state.kv, pos
        for stage, graph in zip(stages, graphs):
            if graph is None:
                prefill.attention_core(self.model, stage, run)
            else:
                graph.replay()

    def _first(self, capture, state, pos, x, eager) -> ShardOutput:
        try:
            entry = self._capture(capture)
        except Exception as error:  # noqa: BLE001 - a capture that fails leaves the eager path, which works
            return self._stay_eager(capture, f"capture failed: {type(error).__name__}: {error}", eager)
        n = x.shape[0]
        self._replay(entry, state, pos, x)  # the graphs from the sequence's state, written back by neither ...
        graphed = prefill.pass_output(self.model, entry[0], copy=True)
        conv, recurrent = self.staging.conv.clone(), self.staging.recurrent.clone()
        kv = {i: (c.key[:, pos:pos + n].clone(), c.value[:, pos:pos + n].clone()) for i, c in state.kv.items()}
        out = eager()  # ... and the eager path from the same state, which the call keeps
        differ = [name for name, a, b in (
            ("logits", graphed.logits, out.logits), ("hidden", graphed.hidden, out.hidden),
            ("conv state", conv, state.gdn.conv), ("recurrent state", recurrent, state.gdn.recurrent),
            *((f"captured layer {i}", graphed.captured[i], out.captured[i]) for i in capture),
            *((f"KV of layer {i}", torch.cat(kv[i]), torch.cat((c.key[:, pos:pos + n], c.value[:, pos:pos + n])))
              for i, c in state.kv.items()),
        ) if (a is None) != (b is None) or (a is not None and not torch.equal(a, b))]
        if differ:
            return self._stay_eager(capture, f"replayed graphs differ from the eager path in {', '.join(differ)}",
                                    lambda: out)
        self.sets[capture] = entry
        return out

    def _stay_eager(self, capture, reason: str, eager) -> ShardOutput:
        self.sets[capture] = None
        self.failures[capture] = reason
        log.warning("prefill graphs of %d rows (captured layers %s) stay off: %s", self.rows, list(capture), reason)
        return eager()

    def _capture(self, capture: tuple[int, ...]):
        """Warm up (compiles and autotunes the kernels, creates the cuBLAS handles) and capture every stage, on
        the staging GDN state and the scratch slot's KV cache, so no sequence's state is touched."""
        model, pools = self.model, self.pools
        if self.staging is None:
            self.staging = GDNStates(pools.gdn_layers, torch.zeros_like(pools.conv[0]),
                                     torch.zeros_like(pools.recurrent[0]))
            self.memory_pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        scratch = pools.state_of(pools.scratch_slot)
        run = prefill.PrefillPass(model, self.rows, model.dtype, model.device, capture)
        run.gdn, run.kv, run.pos = self.staging, scratch.kv, 0
        stages = prefill.prefill_stages(model, self.layers, capture, self.rule)
        if not self.use_graphs:
            return run, stages, [None if isinstance(stage, FusedLayer) else _StageOps(stage, run) for stage in stages]

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                run.hidden.zero_()
                prefill.run_stages(model, stages, run)
        torch.cuda.current_stream().wait_stream(stream)
        graphs = []
        for stage in stages:
            if isinstance(stage, FusedLayer):
                run.delta = run.attention_out  # what the core leaves for the next stage
                graphs.append(None)
                continue
            graph = torch.cuda.CUDAGraph()
            # thread_local: a metrics scrape reading the device's memory from its own thread does not end the capture
            with torch.cuda.graph(graph, pool=self.memory_pool, capture_error_mode="thread_local"):
                for op in stage:
                    op(run)
            graphs.append(graph)
        return run, stages, graphs


class _StageOps:
    """A stage that replays by running its ops (PrefillGraphs without CUDA graphs)."""

    def __init__(self, ops, run: prefill.PrefillPass):
        self.ops, self.run = ops, run

    def replay(self) -> None:
        for op in self.ops:
            op(self.run)
