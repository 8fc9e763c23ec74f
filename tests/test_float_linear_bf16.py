"""float_linear's two paths for bf16 rows times bf16 weights, each taken at
every row count where the CPU has it (QOQSERVE_CPU_ISA picks between them):

* the dot products (AVX512-BF16, float_linear_dot.h): the bits of the order
  it states;
* the AMX-BF16 tiles (float_linear_amx.h): their sum over each block of 32 k
  is the hardware's own, so the reference is the exact product within fp32
  rounding.

On both, bit for bit, a row's outputs do not depend on the rows beside it,
the row blocks, the thread count or the column tiles."""
import pytest
import torch

from qoqserve.kernels.cpu import float_linear

needs_dot = pytest.mark.skipif(not float_linear.available() or float_linear.load().float_linear_simd() < 3,
                               reason="this CPU has no AVX512-BF16 dot products")


@pytest.fixture(autouse=True)
def dot_path_not_amx(monkeypatch):
    """On CPUs with AMX-BF16 the tiles take bf16 calls; capped below AMX, the
    dot products do. A test of the tiles asks for them (take)."""
    monkeypatch.setenv("QOQSERVE_CPU_ISA", "avx512-vnni")


def pair_order(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T summed as the path says: lane l of 16 adds, for each 32
    elements in turn, the product of elements 2l + 1, then of 2l (each
    product of bf16 values exact in fp32, each add rounded), K zero-padded;
    then lanes l + 8, l + 4, l + 2, l + 1."""
    m, k = x.shape
    kp = (k + 31) // 32 * 32
    xs = torch.nn.functional.pad(x.float(), (0, kp - k)).view(m, 1, kp // 32, 16, 2)
    ws = torch.nn.functional.pad(w.float(), (0, kp - k)).view(1, w.shape[0], kp // 32, 16, 2)
    s = torch.zeros(m, w.shape[0], 16)
    for j in range(kp // 32):
        s = s + xs[:, :, j, :, 1] * ws[:, :, j, :, 1]
        s = s + xs[:, :, j, :, 0] * ws[:, :, j, :, 0]
    for h in (8, 4, 2, 1):
        s = s[..., :h] + s[..., h:2 * h]
    return s[..., 0]


@needs_dot
@pytest.mark.parametrize("k", [32, 70, 333, 576])
def test_the_dot_path_sums_in_its_stated_order_at_every_row_count(k):
    g = torch.Generator().manual_seed(k)
    w = torch.randn(150, k, generator=g).bfloat16()  # N off the tiles and column chunks
    b = torch.randn(150, generator=g)
    x = torch.randn(70, k, generator=g).bfloat16()
    want = pair_order(x, w)
    y = float_linear.float_linear(x, w)
    assert float_linear.path() == "avx512-bf16" and torch.equal(y, want)
    exact = x.double() @ w.double().T
    assert (y.double() - exact).abs().max() < 1e-5 * exact.abs().max()
    for rows in (slice(0, 1), slice(1, 3), slice(3, 6), slice(6, 15), slice(15, 70)):
        assert torch.equal(float_linear.float_linear(x[rows], w), want[rows])  # the GEMV and the row tiles alike
    # the bias added after the sum, bf16 outputs rounded as torch rounds the fp32 ones
    assert torch.equal(float_linear.float_linear(x, w, b, out_dtype=torch.bfloat16), (want + b).bfloat16())
    for n in (1, 3, 7):  # fewer columns than a tile
        assert torch.equal(float_linear.float_linear(x[:5], w[:n]), want[:5, :n])


def close_to_exact(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    # fp32 sums of k products: a few ulps of the largest partial sums
    exact = x.double() @ w.double().T
    return bool((y.double() - exact).abs().max() <= 1e-6 * x.shape[1] ** 0.5 * exact.abs().max())


def take(path: str, monkeypatch) -> None:
    """Calls take `path` (avx512-bf16: the dot products, amx-bf16: the tiles,
    below), or the test is skipped where the CPU lacks it."""
    if not float_linear.available() or float_linear.load().float_linear_simd() < float_linear.PATHS.index(path):
        pytest.skip(f"this CPU has no {path} path")
    monkeypatch.setenv("QOQSERVE_CPU_ISA", "amx" if path == "amx-bf16" else "avx512-vnni")
    assert float_linear.path() == path


@pytest.mark.parametrize("path", ["avx512-bf16", "amx-bf16"])
def test_neither_bf16_path_depends_on_the_threads_or_the_row_blocks(path, monkeypatch):
    take(path, monkeypatch)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(200, 576, generator=g).bfloat16()
    x = torch.randn(600, 576, generator=g).bfloat16()  # long calls split into blocks of 256 rows
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = float_linear.float_linear(x, w)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(float_linear.float_linear(x, w), one)
    finally:
        torch.set_num_threads(threads)
    if path == "avx512-bf16":
        assert torch.equal(one, pair_order(x, w))
    else:
        assert close_to_exact(one, x, w)
    for rows in (slice(250, 260), slice(511, 513), slice(599, 600)):
        assert torch.equal(float_linear.float_linear(x[rows], w), one[rows])


@needs_dot
def test_the_isa_cap_below_vnni_turns_the_dot_path_off(monkeypatch):
    monkeypatch.setenv("QOQSERVE_CPU_ISA", "avx512")
    assert float_linear.path() == "avx512" and not float_linear.bf16_dot()
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(5, 100, generator=g).bfloat16(), torch.randn(20, 100, generator=g).bfloat16()
    assert torch.equal(float_linear.float_linear(x, w), float_linear.float_linear(x.float(), w))  # widened
    monkeypatch.setenv("QOQSERVE_CPU_ISA", "avx512-vnni")
    assert float_linear.bf16_dot()


@pytest.mark.parametrize("path", ["avx512-bf16", "amx-bf16"])
def test_where_the_cpu_has_a_bf16_path_every_bf16_linear_runs_on_c(path, monkeypatch):
    # so every decode size of a bf16 model is captured (the runner captures
    # up to the smallest capture_rows: None is no limit)
    from qoqserve.layers.linear import Linear
    from qoqserve.layers.quantization import fp
    take(path, monkeypatch)
    method = fp.CpuDenseLinearMethod()
    assert fp.bf16_all_on_c() and method.capture_rows(torch.bfloat16) is None
    layer = Linear(64, [48], False, method, torch.bfloat16)
    torch.nn.init.normal_(layer.weight)
    method.process_weights_after_loading(layer)
    x = torch.randn(300, 64).bfloat16()
    y = layer(x)
    if path == "avx512-bf16":
        assert torch.equal(y, pair_order(x, layer.weight).bfloat16())
    else:
        assert torch.equal(y, float_linear.float_linear(x, layer.weight, use_simd=4, out_dtype=torch.bfloat16))
    assert torch.equal(layer(x[7:8]), y[7:8])


@pytest.mark.parametrize("k", [32, 70, 333, 576, 1536])
def test_on_the_tiles_every_row_gets_the_bits_it_gets_alone(k, monkeypatch):
    take("amx-bf16", monkeypatch)
    g = torch.Generator().manual_seed(k)
    w = torch.randn(150, k, generator=g).bfloat16()  # N off the 16-row tiles and the 64-column chunks
    b = torch.randn(150, generator=g)
    x = torch.randn(70, k, generator=g).bfloat16()
    assert float_linear.bf16_dot()
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


def test_on_the_tiles_special_values_and_fp32_rows(monkeypatch):
    take("amx-bf16", monkeypatch)
    w = torch.randn(40, 64).bfloat16()
    x = torch.randn(3, 64).bfloat16()
    x[1, 5] = float("inf")
    y = float_linear.float_linear(x, w)
    assert torch.isfinite(y[0]).all() and torch.isfinite(y[2]).all()  # a row's inf stays in its row
    assert not torch.isfinite(y[1]).any()
    # fp32 rows never take the tiles: the fp32 paths' bits, as before
    xf = torch.randn(4, 64)
    assert torch.equal(float_linear.float_linear(xf, w), float_linear.float_linear(xf, w, use_simd=2))


def test_the_isa_cap_below_amx_gives_the_dot_path(monkeypatch):
    take("amx-bf16", monkeypatch)
    monkeypatch.setenv("QOQSERVE_CPU_ISA", "avx512-vnni")
    assert float_linear.path() == "avx512-bf16"
    monkeypatch.setenv("QOQSERVE_CPU_ISA", "amx")
    assert float_linear.path() == "amx-bf16"
