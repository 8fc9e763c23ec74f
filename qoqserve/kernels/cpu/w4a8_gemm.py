"""The QoQ W4A8 linear on packed 4-bit weights (w4a8_gemm.c), via ctypes.

The checkpoint's codes ([N, K/2] bytes, docs/format.md) are repacked once at
load into the kernel's layout (still 4 bits per weight; see the C file's
header) and stay packed: the GEMM unpacks and expands them in registers. One
library holds the AVX-512 VNNI path, an AMX-INT8 one for calls of many rows
and a scalar one; the CPU is probed at run time, and QOQSERVE_CPU_ISA caps
the path (same numbers on every one).
"""
from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch
from torch import nn

from qoqserve.kernels import qoq_ref
from qoqserve.kernels.cpu import graph
from qoqserve.kernels.cpu import isa as cpu_isa
from qoqserve.kernels.cpu.build import load_library, runtime_dispatch_flags
from qoqserve.kernels.cpu.weight_layout import BLOCK_N, OCTET_K, pack_group_params, repack_codes

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
_SIGNATURES = {
    "w4a8_gemm_simd": (_I, []),
    "w4a8_gemm": (_I, [_P, _I, _I, _P, _P, ctypes.c_float, _L, _L, _P, _P, _L, _L, _P, _P, _P, _P, _P, _I, _I,
                       _I, _I]),
}
DTYPES = (torch.float32, torch.bfloat16)  # of the input and output
ISA_ENV = cpu_isa.ENV
_ERRORS = {-1: "could not allocate its scratch buffers", -2: "AVX-512 VNNI (or AMX) is not available on this CPU",
           -3: "got a group size, K or N its layout does not allow", -4: "got an unknown input mode"}
X_PLAIN, X_SILU, X_NORM = 0, 1, 2  # how the kernel makes its input rows (w4a8_gemm.c)


class SiluMulInput(NamedTuple):
    """A linear's input given as silu(gate) * up of gate_up [..., 2K] (gate | up):
    the kernel makes each row and quantizes it in one pass, never writing it out.
    Its rounding is elementwise.silu_mul's, bit for bit."""
    gate_up: torch.Tensor


class NormInput(NamedTuple):
    """A linear's input given as rms_norm(h + delta) * weight (delta None: of h):
    the kernel adds delta into the residual stream h in place, then makes each
    normalized row and quantizes it in one pass, never writing it out. Its
    rounding is elementwise.add_rms_norm's (rms_norm's), bit for bit."""
    h: torch.Tensor
    delta: torch.Tensor | None
    weight: torch.Tensor
    eps: float

    @staticmethod
    def fits(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor) -> bool:
        """What the kernel reads: a contiguous 2-D fp32/bf16 h, delta and the
        weight in its dtype, delta contiguous and of h's shape."""
        return (h.dim() == 2 and h.is_contiguous() and h.dtype in DTYPES and weight.dtype == h.dtype
                and (delta is None or (delta.shape == h.shape and delta.dtype == h.dtype
                                       and delta.is_contiguous())))


def _weight_spans(a: list[int]) -> list[tuple[int, int]]:
    """The bytes a w4a8_gemm call (its argument values a) streams: the codes
    and the group bytes (layout in w4a8_gemm.c)."""
    K, w, gp, group, N = a[7], a[8], a[9], a[10], a[11]
    kp, blocks = -(-K // OCTET_K) * OCTET_K, -(-N // BLOCK_N)
    return [(w, blocks * kp * OCTET_K)] + ([(gp, blocks * BLOCK_N * (kp // group))] if gp and group else [])


def load():
    # no FMA contraction: the reference rounds each product and sum on its own;
    # the AVX-512 functions are chosen at run time (runtime_dispatch_flags)
    lib = load_library("w4a8_gemm", ["-ffp-contract=off", *runtime_dispatch_flags()], _SIGNATURES,
                       team_aware=("w4a8_gemm",))
    if lib is not None:
        lib.w4a8_gemm.streams = _weight_spans
    return lib


def available() -> bool:
    return load() is not None


ISAS = ("scalar", "avx2", "avx512-vnni", "amx")  # by the kernel's simd level 0, 1, 2, 3


def isa() -> str:
    """The code path calls take: "amx" (AMX-INT8 tiles for calls of 12+ rows,
    AVX-512 VNNI below), "avx512-vnni", "avx2" or "scalar": the CPU's best
    under the QOQSERVE_CPU_ISA cap (kernels/cpu/isa.py; avx512, AVX-512
    without VNNI, is avx2 here). Naming avx512-vnni or amx where the CPU lacks
    it is an error."""
    want = cpu_isa.requested()
    if want == "avx512":
        want = "avx2"
    lib = load()
    if lib is None:
        raise RuntimeError("the packed W4A8 kernel could not be built here (no C compiler? see the log)")
    have = int(lib.w4a8_gemm_simd())
    if want in ISAS[2:] and have < ISAS.index(want):
        raise RuntimeError(f"{ISA_ENV}={want}, but this CPU lacks "
                           + ("AMX-INT8 (or the kernel its tile state)" if want == "amx" else "AVX-512 F/BW/VL/VNNI"))
    return ISAS[have if want is None else min(have, ISAS.index(want))]


def simd_level() -> int:
    """isa() as the kernel's simd argument."""
    return ISAS.index(isa())


def check_group_size(k: int, group_size: int) -> None:
    if group_size < 0 or (group_size and (group_size % OCTET_K or k % group_size)):
        raise ValueError(f"packed W4A8 kernel: group size {group_size} must be 0 (per channel) or a "
                         f"multiple of {OCTET_K} dividing K={k} (the format allows 32, 64, 128, 256)")


def w4a8_linear(x2: torch.Tensor, codes: torch.Tensor, gparams: torch.Tensor | None, group_size: int,
                n: int, s1: torch.Tensor, rowsum: torch.Tensor | None = None,
                zs1: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                simd: int | None = None) -> torch.Tensor:
    """x2 [M, K] fp32/bf16 -> [M, n] in x2's dtype on the repacked codes: per-token
    INT8 x2, then acc * s_a * s1 (- rowsum * zs1) (+ bias). s1, zs1, bias: fp32 [n];
    rowsum: fp32 [M] of the unquantized rows (per channel). simd: the path,
    0 scalar, 1 AVX2, 2 VNNI, 3 AMX (ISAS); None = isa()'s."""
    x2 = x2.contiguous()
    m, k = x2.shape
    if codes.shape[1] * OCTET_K < k or codes.shape[0] * BLOCK_N < n:
        raise ValueError(f"packed codes {tuple(codes.shape)} do not cover [{n}, {k}]")
    if simd is None:
        simd = simd_level()
    y = graph.empty(m, n, dtype=x2.dtype)
    bf16 = int(x2.dtype == torch.bfloat16)
    rc = graph.launch(load().w4a8_gemm, x2.data_ptr(), bf16, X_PLAIN, None, None, 0.0, m, k, codes.data_ptr(),
                          None if gparams is None else gparams.data_ptr(), group_size, n, s1.data_ptr(),
                          None if rowsum is None else rowsum.data_ptr(),
                          None if zs1 is None else zs1.data_ptr(),
                          None if bias is None else bias.data_ptr(), y.data_ptr(), bf16, 0, int(simd),
                          torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"packed W4A8 kernel {_ERRORS.get(rc, f'failed ({rc})')}")
    return y


@torch.library.custom_op("qoqserve::w4a8_gemm", mutates_args=())
def w4a8_gemm_op(x2: torch.Tensor, codes: torch.Tensor, gparams: torch.Tensor | None, group_size: int,
                 n: int, s1: torch.Tensor, zs1: torch.Tensor | None, bias: torch.Tensor | None,
                 simd: int) -> torch.Tensor:
    """w4a8_linear as one opaque op of a captured graph (torch.compile)."""
    rowsum = qoq_ref.act_row_sum(x2) if zs1 is not None else None
    return w4a8_linear(x2, codes, gparams, group_size, n, s1, rowsum, zs1, bias, simd)


@w4a8_gemm_op.register_fake
def _(x2, codes, gparams, group_size, n, s1, zs1, bias, simd):
    return x2.new_empty(x2.shape[0], n)


def silu_pair_order(n: int) -> torch.Tensor:
    """The channel order of a gate_up linear of n = 2I outputs (gate | up) whose
    SiLU * mul the kernel makes in its epilogue: 16 gate channels, then the 16
    up channels of the same indices, and so on (w4a8_gemm.c, y_silu)."""
    half = n // 2
    if n % (2 * BLOCK_N):
        raise ValueError(f"silu pairs need gate and up halves of a multiple of {BLOCK_N} channels, got {n}")
    gate = torch.arange(half).view(-1, BLOCK_N)
    return torch.stack([gate, gate + half], 1).reshape(-1)


def silu_pairs_supported(n: int, group_size: int) -> bool:
    """Whether the kernel here makes silu(gate) * up of n = 2I outputs in its
    epilogue: group layouts, halves of whole 16-channel blocks, and any path
    but AVX2's, which has no such epilogue."""
    return bool(group_size) and n % (2 * BLOCK_N) == 0 and isa() != "avx2"


class PackedW4A8Gemm(nn.Module):
    """One QoQ linear with its codes kept 4-bit in the kernel's layout, plus
    fp32 s1 (and z*s1 per channel, bias). Resident: ceil(N/16)*16 x ceil(K/8)*8
    / 2 bytes of codes, 1 byte per channel and group, 4N bytes per vector.

    silu_pairs: the outputs are gate | up halves (a gate_up linear) whose
    silu(gate) * up `silu_mul` makes in the GEMM's epilogue, the channels
    stored in silu_pair_order; `forward` still returns gate | up."""

    def __init__(self, qweight: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor | None,
                 zeros: torch.Tensor, bias: torch.Tensor | None, group_size: int, silu_pairs: bool = False):
        """Checkpoint tensors (docs/format.md): qweight uint8 [N, K/2], s1 [N],
        s2/zeros [N, K/g] (group_size > 0) or zeros [N] and s2 None (per channel)."""
        super().__init__()
        self.out_features, self.in_features = qweight.shape[0], 2 * qweight.shape[1]
        check_group_size(self.in_features, group_size)
        self.group_size = group_size
        self.simd = simd_level()  # QOQSERVE_CPU_ISA is read once, here
        self.silu_pairs = silu_pairs
        if silu_pairs:
            if not silu_pairs_supported(self.out_features, group_size):
                raise ValueError("silu pairs need a group layout, gate and up halves of whole 16-channel "
                                 f"blocks and a kernel path with that epilogue (this CPU's: {isa()})")
            order = silu_pair_order(self.out_features)
            qweight, s1, s2, zeros = qweight[order], s1[order], s2[order], zeros[order]
            bias = None if bias is None else bias[order]
        self.register_buffer("codes", repack_codes(qweight), persistent=False)
        self.register_buffer("gparams", pack_group_params(s2, zeros) if group_size else None,
                             persistent=False)
        self.register_buffer("s1", s1.float().contiguous(), persistent=False)
        self.register_buffer("zs1", None if group_size else (zeros.float() * self.s1).contiguous(),
                             persistent=False)
        self.register_buffer("bias", None if bias is None else bias.float().contiguous(),
                             persistent=False)

        self._bind()

    def _bind(self) -> None:
        if self.codes.dtype != torch.uint8 or any(t is not None and t.dtype != torch.float32
                                                  for t in (self.s1, self.zs1, self.bias)):
            raise TypeError("PackedW4A8Gemm keeps uint8 codes and fp32 epilogue vectors; casting them "
                            "would change its numbers (convert the activations instead)")
        # the per-call arguments that only change when the buffers do: reading
        # six buffers through nn.Module.__getattr__ costs more than the kernel
        # at decode sizes
        ptr = [None if t is None else t.data_ptr() for t in (self.gparams, self.s1, self.zs1, self.bias)]
        self._args = (self.codes.data_ptr(), ptr[0], self.group_size, self.out_features, ptr[1])
        self._tail = (ptr[2], ptr[3])
        self._per_channel = self.zs1 is not None

    def _apply(self, fn, *args, **kwargs):  # .to(), .float(), ...: the buffers may move
        out = super()._apply(fn, *args, **kwargs)
        self._bind()
        return out

    @property
    def resident_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def forward(self, x: torch.Tensor | SiluMulInput | NormInput) -> torch.Tensor:
        """x @ W.T (+ bias): the layer's outputs in its checkpoint's order."""
        y = self._run(x, 0)
        if self.silu_pairs:  # not the model's path (silu_mul is): back from the pair order
            y = y.index_select(-1, torch.argsort(silu_pair_order(self.out_features)))
        return y

    def silu_mul(self, x: torch.Tensor | SiluMulInput | NormInput) -> torch.Tensor:
        """silu(gate) * up of this gate_up layer's output (silu_pairs), [..., N/2], in
        one call: bit for bit what elementwise.silu_mul of `forward`'s output gives."""
        if not self.silu_pairs:
            raise ValueError("silu_mul needs a PackedW4A8Gemm built with silu_pairs=True")
        if torch.compiler.is_compiling():  # the op has no such epilogue: torch's SiLU (the same rounding)
            gate, up = self(x).chunk(2, dim=-1)
            return torch.nn.functional.silu(gate) * up
        return self._run(x, 1)

    def _run(self, x, y_silu: int) -> torch.Tensor:
        mode, delta, norm_w, eps = X_PLAIN, None, None, 0.0
        if isinstance(x, (SiluMulInput, NormInput)):
            if self._per_channel or torch.compiler.is_compiling():
                raise ValueError(f"a {type(x).__name__} needs a group layout and eager mode "
                                 "(the per-channel epilogue needs torch's row sum of the input)")
            if isinstance(x, SiluMulInput):
                mode, x = X_SILU, x.gate_up
            else:
                mode, x, delta, norm_w, eps = X_NORM, x.h, x.delta, x.weight, x.eps
                if not NormInput.fits(x, delta, norm_w):
                    raise ValueError("a NormInput needs a contiguous 2-D fp32/bf16 h, and delta and the "
                                     "weight in h's dtype (delta contiguous, h's shape)")
            if x.dtype not in DTYPES:
                raise ValueError(f"a fused input needs fp32/bf16 activations, got {x.dtype}")
        elif x.dtype not in DTYPES:  # fp16: exact in fp32, and the reference rounds at the end
            return self._run(x.float(), y_silu).to(x.dtype)
        x2 = (x if x.dim() == 2 else x.reshape(-1, x.shape[-1])).contiguous()
        if torch.compiler.is_compiling():  # the graph holds the op, not the ctypes call
            y = w4a8_gemm_op(x2, self.codes, self.gparams, self.group_size, self.out_features,
                             self.s1, self.zs1, self.bias, self.simd)
            return y if x.dim() == 2 else y.reshape(*x.shape[:-1], -1)
        m, k = x2.shape
        if k != self.in_features * (2 if mode == X_SILU else 1) or x2.device.type != "cpu":
            want = f"2 x {self.in_features} (gate | up)" if mode == X_SILU else self.in_features
            raise ValueError(f"expected a CPU input [..., {want}], got {tuple(x.shape)} on {x.device}")
        # the per-channel epilogue needs torch's own row sum to match the reference bit for bit
        rowsum = qoq_ref.act_row_sum(x2) if self._per_channel else None
        y = graph.empty(m, self.out_features // (2 if y_silu else 1), dtype=x2.dtype)
        bf16 = int(x2.dtype == torch.bfloat16)
        rc = graph.launch(load().w4a8_gemm, x2.data_ptr(), bf16, mode,
                          None if delta is None else delta.data_ptr(),
                          None if norm_w is None else norm_w.data_ptr(), eps, m, self.in_features, *self._args,
                          None if rowsum is None else rowsum.data_ptr(), *self._tail, y.data_ptr(),
                          bf16, y_silu, int(self.simd), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"packed W4A8 kernel {_ERRORS.get(rc, f'failed ({rc})')}")
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], -1)
