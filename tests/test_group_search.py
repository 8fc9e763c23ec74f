"""Level-2 group parameters by error search (quant/group_search.py)."""
import torch

from qoqserve.kernels import qoq_ref as Q
from qoqserve.quant.group_search import search_group_params
from qoqserve.quant.weight_quantizer import WeightQuantizer


def _rows(seed=0, n=512, g=64):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, g, generator=gen) * (torch.rand(n, 1, generator=gen) * 3 + 0.1)
    w[::7, 3] *= 12  # outliers that stretch round-to-nearest's range
    w[1::11] = w[1::11].abs()  # one-signed groups (zero at an end of the range)
    s1 = Q.level1_scale(w)
    return w / s1.float()[:, None]


def _err(x, s2, z, weight):
    u = torch.clamp(torch.round(torch.round(x) / s2[:, None]) + z[:, None], 0, 15)
    return (((s2[:, None] * (u - z[:, None])) - x) ** 2 * weight).sum(dim=1), u


def test_search_never_loses_to_round_to_nearest_and_keeps_the_format():
    x = _rows()
    gen = torch.Generator().manual_seed(1)
    for weight in (torch.ones(x.shape[1]), torch.rand(x.shape[1], generator=gen) ** 4):
        s2_r, z_r, _ = Q.level2_params(torch.round(x))
        err_r, _ = _err(x, s2_r, z_r, weight)
        s2, z = search_group_params(x, weight)
        err, u = _err(x, s2, z, weight)
        assert (err <= err_r * (1 + 1e-6) + 1e-6).all()
        assert err.sum() < 0.95 * err_r.sum()  # and wins overall (measured 0.88x unweighted)
        assert torch.equal(s2, s2.round()) and torch.equal(z, z.round())
        assert s2.min() >= 1 and s2.max() <= 16 and z.min() >= 0 and z.max() <= 15
        # s2*(u - z) fits INT8 for every code, not only the ones used
        assert (s2 * (0 - z)).min() >= -128 and (s2 * (15 - z)).max() <= 127


def test_weighting_moves_the_error_to_unimportant_columns():
    x = _rows(seed=2)
    weight = torch.ones(x.shape[1])
    weight[:8] = 100.0  # columns whose inputs are large
    s2_u, z_u = search_group_params(x)
    s2_w, z_w = search_group_params(x, weight)
    mask = torch.zeros(x.shape[1])
    mask[:8] = 1
    err_u, _ = _err(x, s2_u, z_u, mask)
    err_w, _ = _err(x, s2_w, z_w, mask)
    assert err_w.sum() < err_u.sum()


def test_quantizer_with_search_gives_valid_codes():
    torch.manual_seed(3)
    w = torch.randn(64, 256)
    quantizer = WeightQuantizer(w, 64, group_params=lambda x, col: search_group_params(x))
    q = quantizer.quantize_all(w)
    rtn = Q.quantize_weight_group(w, 64)
    err = (Q.group_weight_to_float(q) - w).norm()
    err_rtn = (Q.group_weight_to_float(rtn) - w).norm()
    assert err < err_rtn
    w8 = Q.group_weight_to_int8(q).int()
    assert w8.min() >= -128 and w8.max() <= 127


def test_smooth_attention_strength_search():
    """Keys with outlier channels: the output-error search turns smoothing on; with
    the outliers gone, it leaves it off (alpha 0 wins ties, being first)."""
    from qoqserve.quant.layer_stats import search_key_alpha
    from qoqserve.quant.transforms.key_center import key_rotation

    gen = torch.Generator().manual_seed(4)
    hkv, g, d = 2, 3, 64
    q = torch.randn(256, hkv * g, d, generator=gen)
    k = torch.randn(512, hkv, d, generator=gen)
    v = torch.randn(512, hkv, d, generator=gen)
    grid = (0.0, 0.25, 0.5)
    flat = search_key_alpha(q, k, v, grid, torch.ones(hkv, d))
    assert flat == 0.0
    k[:, :, [5, 5 + d // 2]] *= 30  # one RoPE pair with huge keys, small queries there
    q[:, :, [5, 5 + d // 2]] /= 30
    absmax = k.abs().amax(0)
    assert search_key_alpha(q, k, v, grid, absmax) > 0
    assert search_key_alpha(q, k, v, (0.0,), absmax) == 0.0
    # the rotation alone already spreads the outlier: the search may keep it off,
    # but must return a grid value either way
    rot = search_key_alpha(q, k, v, grid, absmax, k.mean(0), key_rotation(d))
    assert rot in grid


def test_c_search_chooses_what_the_reference_chooses_bit_for_bit():
    """The C search (kernels/cpu/group_search.c) replays the reference's float
    operations in its order, so it must pick the same (s2, z) for every row:
    group sizes 32/64/128, unweighted, weighted, weights spanning 1e4, and
    integer inputs (where many candidates tie)."""
    from qoqserve.kernels.cpu import group_search as cpu_kernel
    gen = torch.Generator().manual_seed(5)
    for g in (32, 64, 128):
        x = _rows(seed=g, n=700, g=g)
        assert cpu_kernel.handles(x)
        for rows in (x, torch.round(x), x[:1]):
            for weight in (None, torch.rand(g, generator=gen) ** 4, torch.rand(g, generator=gen) * 1e4):
                s2_c, z_c = search_group_params(rows, weight)
                s2_t, z_t = search_group_params(rows, weight, kernel=False)
                assert torch.equal(s2_c, s2_t) and torch.equal(z_c, z_t)


def test_c_search_sum_order_is_torchs():
    """What the C kernel's bit-exactness rests on: torch sums a contiguous row of
    g floats (g % 32 == 0) in four 8-lane accumulators over 32-float chunks,
    added in order, then the 8 lanes in order. If a torch release changes
    that, this fails first (and the C search would then only be close)."""
    gen = torch.Generator().manual_seed(6)
    for g in (32, 64, 128):
        t = torch.rand(300, 7, g, generator=gen) ** 3 * 100
        acc = t.reshape(300, 7, g // 32, 4, 8)
        lanes = acc[..., 0, :, :].clone()
        for c in range(1, g // 32):
            lanes = lanes + acc[..., c, :, :]
        four = ((lanes[..., 0, :] + lanes[..., 1, :]) + lanes[..., 2, :]) + lanes[..., 3, :]
        total = four[..., 0]
        for lane in range(1, 8):
            total = total + four[..., lane]
        assert torch.equal(total, t.sum(dim=-1))


def test_group_sizes_the_c_search_does_not_take_use_the_reference():
    from qoqserve.kernels.cpu import group_search as cpu_kernel
    x = _rows(seed=7, n=64, g=48)
    assert not cpu_kernel.handles(x)
    s2, z = search_group_params(x)
    s2_t, z_t = search_group_params(x, kernel=False)
    assert torch.equal(s2, s2_t) and torch.equal(z, z_t)
    try:
        cpu_kernel.group_search(x, torch.ones(48), 0.55)
    except ValueError as e:
        assert "multiple of 32" in str(e)
    else:
        raise AssertionError("a group of 48 must be refused")
