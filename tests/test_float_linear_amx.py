"""float_linear's AMX-BF16 path (float_linear_amx.h): bf16 rows times bf16
weights on the tile unit at every row count. Its sum over each block of 32 k
is the hardware's own, so the reference is the exact product within fp32
rounding; what must hold bit for bit is batch invariance: a row's outputs do
not depend on the rows beside it, the row blocks, the thread count, or the
column tiles (N and K off the tile sizes included; the threads, the row
blocks and a bf16 model's linears: test_float_linear_dot.py, for both bf16
paths)."""
import pytest
import torch

from qoqserve.kernels.cpu import float_linear

needs_amx = pytest.mark.skipif(not float_linear.available() or float_linear.load().float_linear_simd() < 4,
                               reason="this CPU (or this process) has no AMX-BF16 tiles")


@pytest.fixture(autouse=True)
def uncapped(monkeypatch):
    monkeypatch.delenv("QOQSERVE_CPU_ISA", raising=False)


def close_to_exact(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    # fp32 sums of k products: a few ulps of the largest partial sums
    exact = x.double() @ w.double().T
    return bool((y.double() - exact).abs().max() <= 1e-6 * x.shape[1] ** 0.5 * exact.abs().max())


@needs_amx
@pytest.mark.parametrize("k", [32, 70, 333, 576, 1536])
def test_every_row_gets_the_bits_it_gets_alone(k):
    g = torch.Generator().manual_seed(k)
    w = torch.randn(150, k, generator=g).bfloat16()  # N off the 16-row tiles and the 64-column chunks
    b = torch.randn(150, generator=g)
    x = torch.randn(70, k, generator=g).bfloat16()
    assert float_linear.path() == "amx-bf16" and float_linear.bf16_dot()
    y = float_linear.float_linear(x, w)
    assert close_to_exact(y, x, w)
    for r in range(70):
        assert torch.equal(float_linear.float_linear(x[r:r + 1], w), y[r:r + 1]), r
    for rows in (slice(1, 3), slice(3, 20), slice(15, 48), slice(47, 70)):  # tiles of 16 rows, cut anywhere
        assert torch.equal(float_linear.float_linear(x[rows], w), y[rows])
    # the bias added after the sum, bf16 outputs rounded as torch rounds the fp32 ones
    assert torch.equal(float_linear.float_linear(x, w, b, out_dtype=torch.bfloat16), (y + b).bfloat16())
    for n in (1, 3, 17, 33):  # fewer columns than one or two tiles
        assert torch.equal(float_linear.float_linear(x[:5], w[:n].contiguous()), y[:5, :n])


@needs_amx
def test_special_values_and_fp32_rows():
    w = torch.randn(40, 64).bfloat16()
    x = torch.randn(3, 64).bfloat16()
    x[1, 5] = float("inf")
    y = float_linear.float_linear(x, w)
    assert torch.isfinite(y[0]).all() and torch.isfinite(y[2]).all()  # a row's inf stays in its row
    assert not torch.isfinite(y[1]).any()
    # fp32 rows never take the tiles: the fp32 paths' bits, as before
    xf = torch.randn(4, 64)
    assert torch.equal(float_linear.float_linear(xf, w), float_linear.float_linear(xf, w, use_simd=2))


@needs_amx
def test_the_isa_cap_below_amx_gives_the_dot_path(monkeypatch):
    monkeypatch.setenv("QOQSERVE_CPU_ISA", "avx512-vnni")
    assert float_linear.path() == "avx512-bf16"
    monkeypatch.setenv("QOQSERVE_CPU_ISA", "amx")
    assert float_linear.path() == "amx-bf16"
