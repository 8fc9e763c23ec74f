"""The per-token ops of a decoder layer on CPU (elementwise.c), via ctypes:
embedding rows, RMSNorm (alone, or fused with the residual add), q/k/v split
with RoPE and the key transform, SiLU * mul; and the soft-capping and
greedy argmax of the logits. fp32 or bf16 activations."""
from __future__ import annotations

import ctypes

import torch

from qoqserve.kernels.cpu import graph
from qoqserve.kernels.cpu.build import load_library

_P, _I, _L, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "embed_rows": (None, [_P, _P, _P, _L, _L]),
    "embed_scaled": (None, [_P, _P, _P, _L, _L, _F, _I]),
    "concat_rows": (None, [_P, _L, _P, _L, _P]),
    "rms_norm": (None, [_P, _L, _P, _P, _L, _L, _F, _I, _I]),
    "add_rms_norm": (None, [_P, _P, _P, _P, _L, _L, _F, _I, _I]),
    "silu_mul": (None, [_P, _P, _L, _L, _I, _I]),
    "gelu_mul": (None, [_P, _P, _L, _L, _I, _I]),
    "qkv_rope": (None, [_P, _L, _L, _I, _I, _I, _I, _P, _P, _P, _P, _P, _I, _P, _P, _F, _P, _P, _P, _I, _I]),
    "argmax_rows": (None, [_P, _L, _L, _L, _P, _I]),
    "softcap_rows": (None, [_P, _P, _L, _L, _F, _I]),
}
DTYPES = (torch.float32, torch.bfloat16)
MAX_HEAD_DIM = 512
MAX_ROW = 16384  # the C scratch rows: hidden size, intermediate size per chunk


def load():
    return load_library("elementwise", ["-ffp-contract=off"], _SIGNATURES,
                        team_aware=("qkv_rope", "rms_norm", "add_rms_norm", "silu_mul", "gelu_mul", "argmax_rows",
                                    "softcap_rows"),
                        serial=("embed_rows", "embed_scaled", "concat_rows"))


def available() -> bool:
    return load() is not None


def _check(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype not in DTYPES or t.device.type != "cpu":
            raise ValueError(f"CPU elementwise kernels take fp32/bf16 CPU tensors, got {t.dtype} on {t.device}")


def embed(ids: torch.Tensor, table: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """table[ids] (ids int64 [T], table [V, K] contiguous), times scale where
    given (Gemma), rounded as torch's product in the table's dtype."""
    t, k = ids.shape[0], table.shape[1]
    out = graph.empty(t, k, dtype=table.dtype)
    if scale is None:
        graph.launch(load().embed_rows, ids.data_ptr(), table.data_ptr(), out.data_ptr(), t,
                     k * table.element_size())
        return out
    _check(table)
    if k > MAX_ROW:
        raise ValueError(f"embed: rows at most {MAX_ROW} wide")
    graph.launch(load().embed_scaled, ids.data_ptr(), table.data_ptr(), out.data_ptr(), t, k, float(scale),
                 int(table.dtype == torch.bfloat16))
    return out


def concat_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.cat([a, b]) of two contiguous CPU tensors of one dtype and row shape,
    as one C call (a captured or one-shot step may not run torch.cat)."""
    if (a.dtype != b.dtype or a.shape[1:] != b.shape[1:] or not (a.is_contiguous() and b.is_contiguous())
            or a.device.type != "cpu" or b.device.type != "cpu"):
        raise ValueError("concat_rows: contiguous CPU tensors of one dtype and row shape")
    out = graph.empty(a.shape[0] + b.shape[0], *a.shape[1:], dtype=a.dtype)
    graph.launch(load().concat_rows, a.data_ptr(), a.numel() * a.element_size(), b.data_ptr(),
                 b.numel() * b.element_size(), out.data_ptr())
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check(x, weight)
    t, k = x.shape
    if x.stride(1) != 1 or weight.dtype != x.dtype or k > MAX_ROW:
        raise ValueError(f"rms_norm: rows must be contiguous, at most {MAX_ROW} wide, and the "
                         "weight in the activations' dtype")
    y = graph.empty(t, k, dtype=x.dtype)
    graph.launch(load().rms_norm, x.data_ptr(), x.stride(0), weight.data_ptr(), y.data_ptr(), t, k, eps,
                 int(x.dtype == torch.bfloat16), torch.get_num_threads())
    return y


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """h += delta in place (h: the residual stream, contiguous); returns
    (rms_norm(h), h)."""
    _check(h, delta, weight)
    if (not (h.is_contiguous() and delta.is_contiguous()) or delta.dtype != h.dtype
            or weight.dtype != h.dtype or h.shape[1] > MAX_ROW):
        raise ValueError(f"add_rms_norm: contiguous h and delta of one dtype, at most {MAX_ROW} wide")
    t, k = h.shape
    y = graph.empty(t, k, dtype=h.dtype)
    graph.launch(load().add_rms_norm, h.data_ptr(), delta.data_ptr(), weight.data_ptr(), y.data_ptr(), t, k,
                 eps, int(h.dtype == torch.bfloat16), torch.get_num_threads())
    return y, h


def _gated(kernel: str, gate_up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up of gate_up [T, 2I] (gate | up) -> [T, I] by C function `kernel`."""
    _check(gate_up)
    gate_up = gate_up if gate_up.is_contiguous() else gate_up.contiguous()
    t, two_i = gate_up.shape
    y = graph.empty(t, two_i // 2, dtype=gate_up.dtype)
    graph.launch(getattr(load(), kernel), gate_up.data_ptr(), y.data_ptr(), t, two_i // 2,
                 int(gate_up.dtype == torch.bfloat16), torch.get_num_threads())
    return y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up (SwiGLU)."""
    return _gated("silu_mul", gate_up)


def gelu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up (Gemma's GeGLU)."""
    return _gated("gelu_mul", gate_up)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap) of fp32 logits x [T, V] (Gemma 2's final logit
    soft-capping), within 2.5e-7 * cap of torch's, as one C call a captured
    step records."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2:
        raise ValueError(f"softcap: fp32 CPU [T, V] logits, got {x.dtype} {tuple(x.shape)} on {x.device}")
    x = x if x.is_contiguous() else x.contiguous()
    y = graph.empty(*x.shape, dtype=x.dtype)
    graph.launch(load().softcap_rows, x.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], float(cap),
                 torch.get_num_threads())
    return y


def qkv_rope(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             num_heads: int, num_kv_heads: int, head_dim: int, shift: torch.Tensor | None = None,
             rotation: torch.Tensor | None = None, hadamard: bool = False, q_norm: torch.Tensor | None = None,
             k_norm: torch.Tensor | None = None, eps: float = 0.0):
    """qkv [T, (H + 2 Hkv) D] -> q [T, H, D], k, v [T, Hkv, D] (contiguous) with,
    given q_norm and k_norm ([D] weights, the activations' dtype), each q and k
    head RMS-normalized first (rms_norm's rounding, epsilon eps), then
    RoPE on q, k (cos/sin: fp32 [max_pos, Dr], on the first Dr channels of each head (partial rotary where
    Dr < D); None: a layer without RoPE) and, given rotation, the key
    transform q R, (k - shift) R. hadamard: rotation is c [D], the column
    scales of R = H diag(c) with H the Sylvester Hadamard matrix
    (KeyTransform.hadamard_scales), applied as a fast Walsh-Hadamard transform."""
    _check(qkv)
    t = qkv.shape[0]
    if qkv.stride(1) != 1 or head_dim > MAX_HEAD_DIM or head_dim % 2:
        raise ValueError(f"qkv_rope: rows must be contiguous, head_dim even and <= {MAX_HEAD_DIM}")
    if (cos is not None and cos.dtype != torch.float32) or positions.dtype != torch.int64:
        raise ValueError("qkv_rope: fp32 cos/sin tables and int64 positions")
    rotary = head_dim if cos is None else cos.shape[1]
    if rotary % 2 or rotary > head_dim:
        raise ValueError(f"qkv_rope: cos/sin tables of {rotary} channels for heads of {head_dim}")
    if rotation is not None and (rotation.dtype != qkv.dtype or shift.dtype != qkv.dtype
                                 or not (rotation.is_contiguous() and shift.is_contiguous())):
        raise ValueError("qkv_rope: the key transform must be contiguous, in the activations' dtype")
    if (cos is None) != (sin is None) or cos is not None and not (cos.is_contiguous() and sin.is_contiguous()) \
            or not positions.is_contiguous():
        raise ValueError("qkv_rope: contiguous cos/sin tables and positions")
    if hadamard and rotation is not None and (rotation.shape != (head_dim,) or head_dim & (head_dim - 1)):
        raise ValueError("qkv_rope: Hadamard scales are one per channel, head_dim a power of two")
    if (q_norm is None) != (k_norm is None) or q_norm is not None and any(
            n.dtype != qkv.dtype or n.shape != (head_dim,) or not n.is_contiguous() for n in (q_norm, k_norm)):
        raise ValueError("qkv_rope: q and k norm weights come together, [head_dim] in the activations' dtype")
    q = graph.empty(t, num_heads, head_dim, dtype=qkv.dtype)
    k = graph.empty(t, num_kv_heads, head_dim, dtype=qkv.dtype)
    v = graph.empty(t, num_kv_heads, head_dim, dtype=qkv.dtype)
    graph.launch(load().qkv_rope, qkv.data_ptr(), qkv.stride(0), t, num_heads, num_kv_heads, head_dim, rotary,
                 positions.data_ptr(), None if cos is None else cos.data_ptr(), None if sin is None else sin.data_ptr(),
                 None if shift is None else shift.data_ptr(), None if rotation is None else rotation.data_ptr(),
                 int(hadamard and rotation is not None), None if q_norm is None else q_norm.data_ptr(),
                 None if k_norm is None else k_norm.data_ptr(), eps, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                 int(qkv.dtype == torch.bfloat16), torch.get_num_threads())
    return q, k, v


def argmax_takes(logits: torch.Tensor) -> bool:
    """Whether argmax() runs on these logits: fp32 CPU rows [B, V], V > 0,
    each row contiguous, and the library built here."""
    return (logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[1] > 0
            and logits.stride(1) == 1 and logits.device.type == "cpu" and available())


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1) of fp32 CPU rows [B, V] (int64 [B]): the same
    index (first maximum, first NaN), in one vectorized pass per row, the
    rows over the threads; recorded in a captured step, each row's columns
    split between the team's threads as the LM head splits them."""
    if not argmax_takes(logits):
        raise ValueError("argmax takes fp32 CPU rows [B, V] (V > 0) with contiguous rows")
    b, v = logits.shape
    out = graph.empty(b, dtype=torch.int64)
    graph.launch(load().argmax_rows, logits.data_ptr(), logits.stride(0), b, v, out.data_ptr(),
                 torch.get_num_threads())
    return out
