"""The step as CUDA graphs: one runner owns the static buffers and one graph per set of captured layers,
as vLLM's and SGLang's graph runners do, so the model code never learns that graphs exist."""

from __future__ import annotations

import torch

from shardd.fast.step import StepBuffers, run_step
from shardd.kernels import segments


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
        control = b.control.clone()
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
        return graph


class CapturedCall:
    """A fixed-shape call on static buffers (the DFlash drafter's steps, shardd/fast/draft.py): replays its CUDA
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
