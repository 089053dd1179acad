"""The batch sampler's chunk as a CUDA graph: `shardd.engine.head.sampling._verify_chunk` captured once per shape and replayed.

A chunk of `CHUNK_ROWS` rows runs some 35 small ops (softmax, the top-k and top-p cuts, the accept test, the
fixed-point inverse-CDF draw); on the GPU their launches cost more than their arithmetic. Captured, a chunk is
two copies in (its logits, its packed settings), one replay and two small copies out. The graph runs the same
kernels on the same shapes as the op-by-op reference (`shardd.engine.head.sampling._verify_chunk`, which the CPU runs and
the tests compare with), so its answers are the same bits.

A graph is kept per (vocabulary, rows, top_k bucket, whether any row cuts by top_p): the top-k cut reads the
k-th largest value out of `torch.topk(k_max)`, and the k-th value is the same whatever k_max >= k, so k_max is
rounded up to a power of two (at most the vocabulary) and ~18 buckets cover every request. All graphs of a device
share one memory pool and, per chunk shape, one pair of input buffers (they never run at once). A shape whose
capture fails runs op by op from then on, with one warning in the log.
"""

from __future__ import annotations

import logging
import threading

import torch

log = logging.getLogger("shardd.engine.head.sampling")


def k_bucket(top_k_max: int, vocab: int) -> int:
    """top_k_max rounded up to a power of two, at most the vocabulary (0 stays 0: no top-k cut)."""
    if top_k_max <= 0:
        return 0
    return min(1 << (top_k_max - 1).bit_length(), vocab)


class _Captured:
    """One graph: its static inputs and outputs."""

    def __init__(self, logits: torch.Tensor, packed: torch.Tensor, outputs, graph: torch.cuda.CUDAGraph):
        self.logits, self.packed, self.outputs, self.graph = logits, packed, outputs, graph


class ChunkGraphs:
    """The captured chunks of one CUDA device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = None
        self.graphs: dict[tuple, _Captured | None] = {}  # None: capture failed, run op by op
        self.inputs: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (rows, vocab) -> logits, packed

    def run(self, logits: torch.Tensor, packed: torch.Tensor, verify, packed_bytes, *, top_k_max: int,
            any_top_p: bool):
        """(token, accepted) of one chunk, as `verify(logits, packed, top_k_max=, any_top_p=)` computes them (the
        outputs are the caller's; `packed_bytes(rows)` sizes `packed`), or None when this shape could not be captured
        (the caller runs it op by op)."""
        rows, vocab = logits.shape
        bucket = k_bucket(top_k_max, vocab)
        key = (rows, vocab, bucket, any_top_p)
        if key not in self.graphs:
            self.graphs[key] = self._capture(rows, vocab, bucket, any_top_p, verify, packed_bytes)
        captured = self.graphs[key]
        if captured is None:
            return None
        with torch.cuda.device(self.device):  # the graph's device's current stream, whichever device is current
            captured.logits.copy_(logits)
            captured.packed.copy_(packed)
            captured.graph.replay()
            token, accepted = captured.outputs
            return token.clone(), accepted.clone()  # the next replay overwrites the graph's outputs

    def _capture(self, rows: int, vocab: int, bucket: int, any_top_p: bool, verify, packed_bytes) -> _Captured | None:
        try:
            # normal tensors, not inference ones: a daemon samples under inference_mode, a test may not
            with torch.inference_mode(False), torch.cuda.device(self.device):
                if (rows, vocab) not in self.inputs:  # zeros: valid columns (0) and finite logits for the warm-up
                    self.inputs[rows, vocab] = (
                        torch.zeros((rows, vocab), dtype=torch.float32, device=self.device),
                        torch.zeros(packed_bytes(rows), dtype=torch.uint8, device=self.device))
                logits, packed = self.inputs[rows, vocab]
                logits.zero_()  # an earlier replay's settings may name columns past this bucket
                packed.zero_()
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):  # warm-up off the capture: lazy inits, allocator growth
                    for _ in range(2):
                        verify(logits, packed, top_k_max=bucket, any_top_p=any_top_p)
                torch.cuda.current_stream(self.device).wait_stream(side)
                if self.pool is None:
                    self.pool = torch.cuda.graph_pool_handle()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                    outputs = verify(logits, packed, top_k_max=bucket, any_top_p=any_top_p)
                return _Captured(logits, packed, outputs, graph)
        except Exception as error:  # noqa: BLE001 - a shape that cannot be captured still samples, op by op
            log.warning("sampling: chunk %s x %s (top_k bucket %s, top_p %s) runs op by op: capture failed: %s",
                        rows, vocab, bucket, any_top_p, error)
            return None


_graphs: dict[torch.device, ChunkGraphs] = {}
_lock = threading.Lock()


def chunk_graphs(device: torch.device) -> ChunkGraphs:
    """The ChunkGraphs of a CUDA device (made on first use)."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _lock:
        if device not in _graphs:
            _graphs[device] = ChunkGraphs(device)
        return _graphs[device]
