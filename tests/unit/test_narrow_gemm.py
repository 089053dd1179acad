"""The narrow GEMM (shardd/engine/kernels/narrow_gemm.py) and a StackedLinear writing its groups into one output (an FP8
part and an unquantized narrow part, as a checkpoint that leaves the GDN `a` projection in bf16 has): against
x @ w.T and the torch.cat of the parts. Under Triton's interpreter on the CPU (conftest sets it), in float32; on
a GPU in bf16."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the kernels need triton")

from common import quantization  # noqa: E402
from shardd.weights import quant  # noqa: E402
from shardd.engine.kernels import fp8_gemm  # noqa: E402
from shardd.engine.kernels.narrow_gemm import narrow_linear  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32


def _close(y, reference, x, w):
    bound = (2.0**-8 if y.dtype == torch.bfloat16 else 1e-6) * (x.float().abs() @ w.float().abs().t()) + 1e-6
    assert ((y.float() - reference.float()).abs() <= bound).all()


@pytest.mark.parametrize("k", [300, 1100], ids=["one-split", "three-splits"])  # K tiles of 128, 4 a split
def test_a_narrow_product_lands_in_its_columns_and_its_rows_do_not_depend_on_the_others(k):
    from shardd.engine.kernels.narrow_gemm import splits

    assert splits(k) == (1 if k == 300 else 3)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(20, k, generator=gen).to(DEVICE, DTYPE)
    w = torch.randn(40, k, generator=gen).to(DEVICE, DTYPE)
    wide = torch.full((20, 70), 7.0, dtype=DTYPE, device=DEVICE)
    narrow_linear(x, w, wide[:, 10:50])
    _close(wide[:, 10:50], x.float() @ w.float().t(), x, w)
    assert (wide[:, :10] == 7).all() and (wide[:, 50:] == 7).all()  # nothing outside its columns
    for m in (1, 7, 17):  # a row's bits do not depend on how many rows came (nor on the other rows' values)
        alone = torch.empty(m, 40, dtype=DTYPE, device=DEVICE)
        assert torch.equal(narrow_linear(x[:m], w, alone), wide[:m, 10:50])
    other = torch.randn_like(x)
    other[3] = x[3]
    assert torch.equal(narrow_linear(other, w, torch.empty(20, 40, dtype=DTYPE, device=DEVICE))[3], wide[3, 10:50])
    with pytest.raises(ValueError, match="narrow_linear"):
        narrow_linear(x, w, wide[:, 10:49])


def test_a_stacked_fp8_and_narrow_matrix_writes_each_part_into_one_output():
    gen = torch.Generator().manual_seed(6)
    fp8_part = quant.Fp8Linear(*quant.quantize(torch.randn(136, 300, generator=gen), quantization.FP8_BLOCK), (128, 128),
                               kernel=fp8_gemm.fp8_linear)
    fp8_part = quant.Fp8Linear(fp8_part.weight.to(DEVICE), fp8_part.scale.to(DEVICE), (128, 128),
                               kernel=fp8_gemm.fp8_linear)
    narrow = torch.randn(48, 300, generator=gen).to(DEVICE, DTYPE)
    stacked = quant.StackedLinear([fp8_part, narrow])
    x = torch.randn(16, 300, generator=gen).to(DEVICE, DTYPE)
    y = torch.nn.functional.linear(x, stacked)
    assert y.shape == (16, 184) and y.dtype == DTYPE
    assert torch.equal(y[:, :136], fp8_gemm.fp8_linear(x, fp8_part.weight, fp8_part.scale, (128, 128)))
    _close(y[:, 136:], x.float() @ narrow.float().t(), x, narrow)
    for m in (1, 7):  # a row's bits do not depend on how many rows came
        assert torch.equal(torch.nn.functional.linear(x[:m], stacked), y[:m])
