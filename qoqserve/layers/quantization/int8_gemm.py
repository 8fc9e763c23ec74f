"""The INT8 GEMM every INT8 linear method on CPU ends in (W8A8, QoQ W4A8):
y = s_a * s1 * (x_q @ w^T) (- rowsum(x) * z * s1) (+ b), x quantized per token.

Two ways to run it, same numbers bit for bit:
* ``PackedInt8Gemm``: the weight repacked once at load for the fused C kernel
  (kernels/cpu/int8_linear.c: quantize, VNNI GEMM and epilogue in one call);
* ``int8_linear``: torch._int_mm between separate quantize and epilogue
  passes (C or torch), for CPUs without VNNI and for weights expanded per call.
"""
from __future__ import annotations

import torch
from torch import nn

from qoqserve.kernels import qoq_ref
from qoqserve.kernels.cpu import int8_linear as kernel
from qoqserve.kernels.cpu import w4a8_ops


def int8_linear(x: torch.Tensor, w_int8: torch.Tensor, s1: torch.Tensor, zeros: torch.Tensor | None,
                bias: torch.Tensor | None, cpu_ops: bool) -> torch.Tensor:
    """x @ (s1 * (w - z))^T on INT8 math, in x's dtype: per-token INT8 x, INT32
    GEMM, epilogue. zeros: per-channel zero points (w = the 0..15 codes), or None
    (w is already the signed INT8 operand). cpu_ops: the activation quantization
    and epilogue run as one C pass each (bit-identical to the torch reference)."""
    x2, lead = x.reshape(-1, x.shape[-1]), x.shape[:-1]
    if cpu_ops and w4a8_ops.supports(x2):
        x_q, s_a = w4a8_ops.quantize_act_int8(x2)
        w8 = w_int8.view(torch.int8) if w_int8.dtype == torch.uint8 else w_int8
        acc = qoq_ref.int8_mm(x_q, w8)
        rowsum = zs1 = None
        if zeros is not None:
            rowsum, zs1 = qoq_ref.act_row_sum(x2), zeros.float() * s1.float()
        return w4a8_ops.epilogue(acc, s_a, s1, x.dtype, rowsum, zs1, bias).reshape(*lead, -1)
    if zeros is None:
        y = qoq_ref.w4a8_group_linear(x, w_int8, s1)
    else:
        y = qoq_ref.w4a8_channel_linear(x, w_int8, s1, zeros)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def fused_int8_available() -> bool:
    """The fused C kernel builds, for AVX-512 VNNI or AVX2."""
    return kernel.available()


class PackedInt8Gemm(nn.Module):
    """One linear's INT8 weight in the fused kernel's layout, with its fp32
    epilogue vectors (z * s1 computed here once, not per call). A submodule of
    its Linear, so its buffers count in the resident bytes: ceil(N/16)*16 x
    ceil(K/4)*4 bytes of weight, 4N of s1, 4N of z*s1 (per channel), 4N of bias."""

    def __init__(self, w: torch.Tensor, s1: torch.Tensor, zeros: torch.Tensor | None,
                 bias: torch.Tensor | None):
        """w [N, K]: the signed INT8 operand, or with per-channel `zeros` the
        uint8 codes 0..15 (then the kernel needs no offset: codes are unsigned)."""
        super().__init__()
        self.out_features, self.in_features = w.shape
        self.offset = 0 if zeros is not None else 128
        self.register_buffer("packed", kernel.pack_weight(w, self.offset), persistent=False)
        self.register_buffer("s1", s1.float().contiguous(), persistent=False)
        self.register_buffer("zs1", None if zeros is None else (zeros.float() * self.s1).contiguous(),
                             persistent=False)
        self.register_buffer("bias", None if bias is None else bias.float().contiguous(),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2, lead = x.reshape(-1, x.shape[-1]), x.shape[:-1]
        if x2.dtype not in kernel.DTYPES:  # fp16: exact in fp32, and the reference rounds at the end
            return self(x2.float()).to(x.dtype).reshape(*lead, -1)
        # the per-channel epilogue needs torch's own row sum to match the reference bit for bit
        rowsum = qoq_ref.act_row_sum(x2) if self.zs1 is not None else None
        y = kernel.int8_linear(x2, self.packed, self.out_features, self.offset, self.s1, rowsum,
                               self.zs1, self.bias)
        return y.reshape(*lead, -1)


def install_packed_gemm(layer: nn.Module, w: torch.Tensor, s1: torch.Tensor,
                        zeros: torch.Tensor | None, bias: torch.Tensor | None) -> None:
    """Give `layer` the fused kernel's weight (`layer.int8_gemm`) and drop the
    loaded tensors it replaces, so only what the kernel reads stays resident."""
    gemm = PackedInt8Gemm(w, s1, zeros, bias)
    for name in ("weight", "qweight", "s1", "s2", "zeros", "bias"):
        if name in layer._parameters:
            del layer._parameters[name]
    layer.int8_gemm = gemm
