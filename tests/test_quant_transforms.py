"""QoQ offline transforms: each must leave the model's logits unchanged.

Models are fp32 (the model's RMSNorm and RoPE compute in fp32 whatever the
dtype, so a float64 copy would not be exact either); the transforms compute in
float64 and round once. Logit differences are judged relative to the largest
logit: REL_TOL below; measured errors are 3e-7..6e-7 (tiny models) and
~1e-6 (SmolLM2, 8 layers), while the wrong transforms tried here move logits
by 4e-2..0.45.
"""
import copy
import dataclasses
import re

import pytest
import torch
from test_model_parity import SMALL, ours_from, tiny_llama3, tiny_qwen2

from qoqserve.layers.attention import AttentionMetadata
from qoqserve.layers.attention_backends import AttentionBackend
from qoqserve.layers.kv_cache import DenseKVCacheLayout
from qoqserve.model_loader import load_model_source
from qoqserve.models.llama import LlamaForCausalLM
from qoqserve.quant.hadamard import hadamard_matrix, orthogonal_matrix
from qoqserve.quant.transforms.key_center import center_and_rotate_keys
from qoqserve.quant.transforms.reorder import reorder_down, reorder_out_proj
from qoqserve.quant.transforms.rotation import fold_norms, rotate_model, rotate_values
from qoqserve.quant.transforms.smooth import (
    pair_max,
    smooth_attention,
    smooth_down,
    smooth_out_proj,
    smooth_scales,
)

REL_TOL = 2e-5


def logits(model, ids):
    meta = AttentionMetadata(True, None, None, None, [0, len(ids)], [0])
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(len(ids)), meta, None))


def rel_err(a, b):
    return ((a - b).abs().max() / a.abs().max()).item()


def assert_same(a, b, tol=REL_TOL):
    assert a.abs().max() > 0.1
    err = rel_err(a, b)
    assert err < tol, err


class Capture:
    """Inputs of chosen submodules, per layer, via forward pre-hooks."""

    def __init__(self, model, pick):
        self.seen = {}
        self.hooks = [pick(layer).register_forward_pre_hook(self._hook(i))
                      for i, layer in enumerate(model.layers)]

    def _hook(self, i):
        def hook(module, args):
            self.seen[i] = tuple(a.detach().clone() for a in args if isinstance(a, torch.Tensor))
        return hook

    def close(self):
        for h in self.hooks:
            h.remove()


def capture(model, ids, *picks):
    """One forward pass: (logits, per pick {layer index: inputs of that submodule})."""
    caps = [Capture(model, pick) for pick in picks]
    try:
        out = logits(model, ids)
    finally:
        for cap in caps:
            cap.close()
    return out, [cap.seen for cap in caps]


def spread_absmax(n, gen):
    """Positive values spanning four orders of magnitude: smoothing and sorting bite."""
    return 10 ** (torch.rand(n, generator=gen) * 4 - 2)


# --- Hadamard ---------------------------------------------------------------

POW2 = [1 << k for k in range(0, 11)]
KNOWN = [12, 20, 24, 28, 36, 44, 60, 72, 76, 576, 1536, 5120]


@pytest.mark.parametrize("n", POW2 + KNOWN)
def test_hadamard_is_hadamard(n):
    h = hadamard_matrix(n)
    assert h is not None and h.shape == (n, n)
    assert set(h.unique().tolist()) <= {-1.0, 1.0}
    hf = h.float()  # integer sums < 2^24: exact in fp32, and 2x faster than fp64
    # large orders: a spread of rows against all (the full product costs seconds)
    gen = torch.Generator().manual_seed(n)
    rows = torch.arange(n) if n <= 2048 else torch.randperm(n, generator=gen)[:256]
    assert torch.equal(hf[rows] @ hf.T, n * torch.eye(n)[rows])


def test_hadamard_small_orders_and_gaps():
    built = [n for n in range(1, 200) if hadamard_matrix(n) is not None]
    for n in built:
        h = hadamard_matrix(n)
        assert torch.equal(h @ h.T, n * torch.eye(n, dtype=h.dtype)), n
    assert all(n in (1, 2) or n % 4 == 0 for n in built)
    # 52 = 4 * 13 would need GF(25) (a prime power), which is not built
    assert hadamard_matrix(52) is None and hadamard_matrix(6) is None


@pytest.mark.parametrize("n", [576, 64, 52, 7])
def test_orthogonal_matrix(n):
    q = orthogonal_matrix(n, seed=3)
    assert q.dtype == torch.float64
    torch.testing.assert_close(q @ q.T, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)
    assert torch.equal(q, orthogonal_matrix(n, seed=3))
    assert not torch.equal(q, orthogonal_matrix(n, seed=4))
    if hadamard_matrix(n) is not None:  # signed Hadamard: every entry +-1/sqrt(n)
        torch.testing.assert_close(q.abs() * n ** 0.5, torch.ones(n, n, dtype=torch.float64))
    assert orthogonal_matrix(n, seed=None, dtype=torch.float32).dtype == torch.float32


# --- tiny random models -----------------------------------------------------


def tiny(make):
    torch.manual_seed(0)
    model, arch = ours_from(make().eval())
    with torch.no_grad():  # HF norms start at 1, which would make folding trivial
        for p in [model.norm.weight] + [n.weight for layer in model.layers
                                        for n in (layer.input_layernorm,
                                                  layer.post_attention_layernorm)]:
            p.uniform_(0.3, 3.0)
    return model, arch


IDS = torch.randint(0, SMALL["vocab_size"], (96,), generator=torch.Generator().manual_seed(1))
MAKERS = pytest.mark.parametrize("make", [tiny_llama3, tiny_qwen2])


@MAKERS
def test_fold_norms_and_rotation_preserve_logits(make):
    model, arch = tiny(make)
    before = logits(model, IDS)
    embed = model.embed_tokens.clone()
    fold_norms(model)
    assert model.lm_head is not model.embed_tokens and not model.cfg.tie_word_embeddings
    assert torch.equal(model.embed_tokens, embed)
    assert_same(before, logits(model, IDS))
    q = rotate_model(model, seed=5)
    assert q.shape == (arch.hidden_size,) * 2
    assert_same(before, logits(model, IDS))
    for n in [model.norm] + [m for layer in model.layers
                             for m in (layer.input_layernorm, layer.post_attention_layernorm)]:
        assert torch.all(n.weight == 1)


@MAKERS
def test_value_rotation_preserves_logits_and_mixes_channels(make):
    model, arch = tiny(make)
    before = logits(model, IDS)
    d = arch.head_dim
    v0 = (arch.num_heads + arch.num_kv_heads) * d
    v_before = model.layers[0].self_attn.qkv_proj.weight[v0:v0 + d].clone()
    r = rotate_values(model, seed=3)
    assert_same(before, logits(model, IDS))
    assert torch.allclose(r @ r.T, torch.eye(d, dtype=r.dtype), atol=1e-12)
    v_after = model.layers[0].self_attn.qkv_proj.weight[v0:v0 + d]
    torch.testing.assert_close(v_after.double(), r.T @ v_before.double(), atol=1e-6, rtol=1e-6)


@MAKERS
def test_smoothing_and_reordering_preserve_logits(make):
    model, arch = tiny(make)
    h, hkv, d, inter = arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.intermediate_size
    before = logits(model, IDS)
    gen = torch.Generator().manual_seed(2)
    for layer in model.layers:
        w0 = layer.self_attn.qkv_proj.weight.clone()
        perm = reorder_down(layer, spread_absmax(inter, gen))
        assert torch.equal(perm.sort().values, torch.arange(inter))
        assert not torch.equal(perm, torch.arange(inter))
        perm = reorder_out_proj(layer, spread_absmax(h * d, gen), h, hkv, d)
        assert torch.equal(perm.sort().values, torch.arange(h * d))
        assert torch.equal(perm // d, torch.arange(h * d) // d)  # never leaves its head
        s = smooth_down(layer, spread_absmax(inter, gen), 0.5)
        assert s.shape == (inter,) and s.max() / s.min() > 10
        s = smooth_out_proj(layer, spread_absmax(h * d, gen), 0.5, h, hkv, d)
        assert s.shape == (hkv, d) and s.max() / s.min() > 10
        lam = smooth_attention(layer, spread_absmax(hkv * d, gen).reshape(hkv, d), 0.5, h, hkv, d)
        assert torch.equal(lam[:, :d // 2], lam[:, d // 2:])
        assert not torch.equal(w0, layer.self_attn.qkv_proj.weight)
    assert_same(before, logits(model, IDS))


def test_wrong_transforms_change_logits():
    """The equality checks above can fail: near-miss transforms are caught."""
    model, arch = tiny(tiny_qwen2)
    h, hkv, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
    before = logits(model, IDS)
    gen = torch.Generator().manual_seed(3)
    # lambda not pair-equal: does not commute with RoPE
    bad = copy.deepcopy(model)
    lam = spread_absmax(hkv * d, gen).reshape(hkv, d)
    per_q = lam.repeat_interleave(h // hkv, 0).reshape(-1)
    qkv = bad.layers[0].self_attn.qkv_proj
    with torch.no_grad():
        k_rows = slice(h * d, (h + hkv) * d)
        for rows, f in ((slice(0, h * d), per_q), (k_rows, 1 / lam.reshape(-1))):
            qkv.weight[rows] *= f[:, None]
            qkv.bias[rows] *= f
    assert rel_err(before, logits(bad, IDS)) > 1e-2
    # the same lambda made pair-equal is harmless
    good = copy.deepcopy(model)
    smooth_attention(good.layers[0], lam, alpha=1.0)
    assert_same(before, logits(good, IDS))
    # down smoothing folded into gate rows instead of up rows: silu breaks it
    bad = copy.deepcopy(model)
    mlp = bad.layers[0].mlp
    s = spread_absmax(arch.intermediate_size, gen)
    with torch.no_grad():
        mlp.gate_up_proj.weight[:arch.intermediate_size] /= s[:, None]
        mlp.down_proj.weight *= s[None, :]
    assert rel_err(before, logits(bad, IDS)) > 1e-2


def test_smooth_scales_guard_zeros_and_nans():
    act = torch.tensor([4.0, 0.0, float("nan"), 1.0])
    w = torch.tensor([1.0, 1.0, 1.0, 0.0])
    s = smooth_scales(act, w, 0.5)
    assert torch.isfinite(s).all() and (s >= 1e-5).all()
    assert s[0].item() == pytest.approx(2.0)
    assert pair_max(torch.tensor([[1.0, 5.0, 3.0, 2.0]])).tolist() == [[3.0, 5.0, 3.0, 5.0]]


# --- the embedded SmolLM2 (hidden 576 = 36 x 16) ---------------------------
# Only its first SMOL_LAYERS of 30 layers: real weights and activations (the
# massive residual outliers are there from layer 1 on) at a quarter the cost.
SMOL_LAYERS = 8


def _first_layers(tensors, n):
    for name, tensor in tensors:
        m = re.search(r"layers\.(\d+)\.", name)
        if m is None or int(m.group(1)) < n:
            yield name, tensor


def _residual(model, ids):
    """Logits and the residual stream entering each layer [L, T, hidden]."""
    out, (seen,) = capture(model, ids, lambda layer: layer.input_layernorm)
    return out, torch.stack([seen[i][0] for i in range(len(model.layers))])


def _max_over_rms(h):
    return (h.abs().amax(-1) / h.pow(2).mean(-1).sqrt()).mean().item()


@pytest.fixture(scope="module")
def smol_rotated():
    """The truncated SmolLM2 before (logits, residual stream) and after rotate_model."""
    source = load_model_source(None)
    arch = dataclasses.replace(source.arch, num_layers=SMOL_LAYERS)
    model = LlamaForCausalLM(arch, AttentionBackend(DenseKVCacheLayout(arch.num_kv_heads, arch.head_dim, 16,
                                                                       torch.float32)), torch.float32)
    model.load_weights(_first_layers(source.iter_tensors(), SMOL_LAYERS))
    text = ("The quick brown fox jumps over the lazy dog. Quantization maps real numbers "
            "to a small set of integers, and rotations spread outliers across channels. ")
    ids = torch.tensor(source.tokenizer.encode(text * 3)[:64])
    assert model.cfg.tie_word_embeddings and hadamard_matrix(arch.hidden_size) is not None
    before, h_before = _residual(model, ids)
    q = rotate_model(model)
    return model, ids, q, before, h_before


def test_rotation_on_smollm2(smol_rotated):
    model, ids, q, before, h_before = smol_rotated
    after, h_after = _residual(model, ids)
    assert_same(before, after)
    assert torch.all(model.norm.weight == 1) and model.lm_head is not model.embed_tokens
    # the residual stream is exactly the old one rotated
    expect = (h_before.double() @ q).float()
    assert rel_err(expect, h_after) < 1e-4
    # massive-activation channels get spread: max/rms drops (measured ~12 -> ~3)
    ratio_before, ratio_after = _max_over_rms(h_before), _max_over_rms(h_after)
    assert ratio_after < 0.5 * ratio_before, (ratio_before, ratio_after)


def _key_absmax(seen):
    """Post-RoPE key absmax [Hkv, D] per layer from captured attention inputs (q, k, v)."""
    return [seen[i][1].abs().amax(0) for i in range(len(seen))]


PICKS = (lambda layer: layer.mlp.down_proj, lambda layer: layer.self_attn.o_proj,
         lambda layer: layer.self_attn.attn)


def _spread(keys):
    """Mean over layers and kv heads of max / median channel absmax."""
    return torch.stack([(k.amax(-1) / k.median(-1).values).mean() for k in keys]).mean().item()


def test_full_pipeline_on_smollm2(smol_rotated):
    """rotate -> reorder -> smooth with real calibration statistics."""
    rotated, ids, _, before, _ = smol_rotated
    model = copy.deepcopy(rotated)
    _, (down_in, o_in, attn_in) = capture(model, ids, *PICKS)
    keys = _key_absmax(attn_in)
    applied = []
    for i, layer in enumerate(model.layers):
        act_down = down_in[i][0].abs().amax(0)
        act_o = o_in[i][0].abs().amax(0)
        # statistics follow their channels to the new positions
        perm_down, perm_o = reorder_down(layer, act_down), reorder_out_proj(layer, act_o)
        s_down = smooth_down(layer, act_down[perm_down], 0.15)
        s_o = smooth_out_proj(layer, act_o[perm_o], 0.15)
        lam = smooth_attention(layer, keys[i], 0.5)
        assert torch.equal(lam, pair_max(lam))
        applied.append((perm_down, s_down, perm_o, s_o))
    after, (new_down, new_o, new_attn) = capture(model, ids, *PICKS)
    assert_same(before, after)
    # the linears now read the old activations permuted, then divided by s
    g = model.cfg.num_heads // model.cfg.num_kv_heads
    for i, (perm_down, s_down, perm_o, s_o) in enumerate(applied):
        expect = down_in[i][0].double()[:, perm_down] / s_down
        assert rel_err(expect.float(), new_down[i][0]) < 1e-4
        expect = o_in[i][0].double()[:, perm_o] / s_o.repeat_interleave(g, 0).reshape(-1)
        assert rel_err(expect.float(), new_o[i][0]) < 1e-4
    # SmoothAttention flattens the post-RoPE key channel ranges
    spread_before, spread_after = _spread(keys), _spread(_key_absmax(new_attn))
    assert spread_after < 0.6 * spread_before, (spread_before, spread_after)


def _with_key_transform(model, arch):
    attention = AttentionBackend(DenseKVCacheLayout(arch.num_kv_heads, arch.head_dim, 16, torch.float32))
    kt = LlamaForCausalLM(arch, attention, torch.float32, key_transform=True)
    missing, unexpected = kt.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all("key_transform" in m for m in missing)
    return kt


@MAKERS
def test_key_transform_preserves_logits_and_centers_keys(make):
    model, arch = tiny(make)
    before = logits(model, IDS)
    kt_model = _with_key_transform(model, arch)
    assert_same(before, logits(kt_model, IDS))  # starts as the identity
    _, (raw,) = capture(kt_model, IDS, lambda layer: layer.self_attn.attn)
    for i, layer in enumerate(kt_model.layers):
        key_mean = raw[i][1].mean(0) + 3.0  # any shift is exact; the true mean centers
        center_and_rotate_keys(layer, key_mean - 3.0, seed=i)
        r = layer.self_attn.key_transform.rotation.double()
        assert torch.allclose(r @ r.T, torch.eye(arch.head_dim, dtype=r.dtype), atol=1e-6)
    after, (seen,) = capture(kt_model, IDS, lambda layer: layer.self_attn.attn)
    assert_same(before, after)
    for i in range(arch.num_layers):
        k = seen[i][1]
        assert k.mean(0).abs().max() < 1e-4 * k.abs().max()
        assert raw[i][1].mean(0).abs().max() > 1e-2 * raw[i][1].abs().max()
    # the same rotation applied to keys only is not attention-invariant
    bad = copy.deepcopy(kt_model)
    with torch.no_grad():
        kt = bad.layers[0].self_attn.key_transform
        kt.forward = lambda q, k, kt=kt: (q, (k - kt.shift) @ kt.rotation)
    assert rel_err(before, logits(bad, IDS)) > 1e-2


def test_key_transform_after_smooth_attention(smol_rotated):
    """SmolLM2: SmoothAttention then centering with the lambda-scaled mean keeps
    the logits, and the 4-bit error of the keys, mapped back to the original
    key space (what attention scores see), drops (measured ~0.5x)."""
    from qoqserve.kernels.kv_ref import dequantize_kv4, quantize_kv4

    def kv4_delta(k):
        return dequantize_kv4(*quantize_kv4(k), torch.float32) - k

    rotated, ids, _, before, _ = smol_rotated
    model = _with_key_transform(rotated, rotated.cfg)
    _, (raw,) = capture(model, ids, lambda layer: layer.self_attn.attn)
    lams = []
    for i, layer in enumerate(model.layers):
        k = raw[i][1]
        centered = torch.maximum(k.amax(0) - k.mean(0), k.mean(0) - k.amin(0))
        lams.append(smooth_attention(layer, centered, 0.5))
        center_and_rotate_keys(layer, k.mean(0), lams[-1])
    after, (seen,) = capture(model, ids, lambda layer: layer.self_attn.attn)
    assert_same(before, after)
    err_raw = err_new = 0.0
    for i, layer in enumerate(model.layers):
        r = layer.self_attn.key_transform.rotation
        back = (kv4_delta(seen[i][1]) @ r.T) * lams[i].float()  # k = (k' R^T + shift) * lambda
        err_raw += kv4_delta(raw[i][1]).norm().item()
        err_new += back.norm().item()
    assert err_new < 0.75 * err_raw, (err_raw, err_new)
