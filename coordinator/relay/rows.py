"""Row tensors on the coordinator's side: parts of the same rows side by side, row chunks end to end."""

from __future__ import annotations

from typing import Sequence

import numpy

from protocol import WireTensor
from protocol.tensors import concat_rows


def side_by_side(parts: Sequence[WireTensor], rows: slice = slice(None)) -> WireTensor:
    """Tensors [n, H_i] of one dtype and the same rows as one [n, sum H_i], each row's parts end to end (their
    `rows` only: a slice of the n); one numpy copy of the bytes, whatever the dtype."""
    n = parts[0].shape[0]
    blocks = [numpy.frombuffer(part.data, dtype=numpy.uint8).reshape(n, part.shape[1] * part.itemsize)[rows]
              for part in parts]
    joined = numpy.concatenate(blocks, axis=1)
    return WireTensor(parts[0].dtype, (joined.shape[0], sum(part.shape[1] for part in parts)), joined.reshape(-1))


def join_rows(chunks: Sequence[WireTensor]) -> WireTensor:
    """Row chunks [n_i, H] of one tensor as one [sum n_i, H] (row-major: the bytes end to end)."""
    return concat_rows(list(chunks))
