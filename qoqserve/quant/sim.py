"""Turning a calibrated fp32 linear into its quantized form, in memory.

QoQ formats become a QoQSimMethod layer (the same parameters the
checkpoint stores, executed by the `sim` backend); the baselines of the
accuracy table (W8A8, plain W4 groups) become FakeQuantLinearMethod layers.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from qoqserve.kernels import qoq_ref
from qoqserve.layers.linear import Linear, LinearMethod
from qoqserve.layers.quantization.int8_gemm import PackedInt8Gemm, fused_int8_available, int8_linear
from qoqserve.layers.quantization.qoq_methods import QoQSimMethod
from qoqserve.layers.quantization.w8a8 import quantize_weight_per_channel


def fake_quant_act_int8(x: torch.Tensor) -> torch.Tensor:
    x_q, scale = qoq_ref.quantize_act_int8(x)
    return (x_q.float() * scale[..., None]).to(x.dtype)


def qoq_rtn(w: torch.Tensor, group_size: int, clip=None) -> torch.Tensor:
    """Round-to-nearest in the QoQ format (progressive groups or per channel), dequantized."""
    if group_size:
        return qoq_ref.group_weight_to_float(qoq_ref.quantize_weight_group(w, group_size, clip))
    return qoq_ref.channel_weight_to_float(qoq_ref.quantize_weight_channel(w, clip))


def rtn_weight(w: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Baseline round-to-nearest, dequantized: 8-bit symmetric per channel, or
    4-bit asymmetric min/max per group (per channel when group_size is 0)."""
    w = w.float()
    if bits == 8:
        scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-8)
        return torch.clamp(torch.round(w / scale), -127, 127) * scale
    n, k = w.shape
    g = group_size or k
    wg = w.reshape(n, k // g, g)
    lo, hi = wg.amin(-1, keepdim=True).clamp(max=0), wg.amax(-1, keepdim=True).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    zero = torch.round(-lo / scale)
    q = torch.clamp(torch.round(wg / scale) + zero, 0, 2**bits - 1)
    return ((q - zero) * scale).reshape(n, k)


class FakeQuantLinearMethod(LinearMethod):
    """Dequantized weights, optionally INT8 fake-quantized activations."""

    def __init__(self, quantize_activations: bool, label: str):
        self.quantize_activations = quantize_activations
        self.name = label

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=dtype),
                                    requires_grad=False)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.quantize_activations:
            x = fake_quant_act_int8(x)
        return F.linear(x, layer.weight, layer.bias if layer.has_bias else None)


class SimW8A8Method(FakeQuantLinearMethod):
    """A linear kept at W8A8 in a QoQ model: holds the float weight the checkpoint
    stores (W8A8LinearMethod quantizes it at load), runs the per-channel INT8
    codes it will get with per-token INT8 activations, summed in fp32 as the
    QoQ simulation does."""

    def __init__(self):
        super().__init__(True, "sim-w8a8")

    def process_weights_after_loading(self, layer: Linear) -> None:
        codes, scale = quantize_weight_per_channel(layer.weight.detach())
        layer.register_buffer("w_codes", codes.float(), persistent=False)
        layer.register_buffer("w_scale", scale, persistent=False)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        y = qoq_ref.w4a8_group_linear_sim(x, layer.w_codes, layer.w_scale)
        if layer.has_bias:
            y = y + layer.bias.float()
        return y.to(x.dtype)


def _swap_method(layer: Linear, method: LinearMethod) -> torch.Tensor | None:
    bias = layer.bias.detach().clone() if layer.has_bias else None
    for name in list(layer._parameters):
        del layer._parameters[name]
    layer.method = method
    method.create_weights(layer, torch.float32)
    if bias is not None:
        layer.bias.data.copy_(bias)
    return bias


class IntegerGemmSimMethod(QoQSimMethod):
    """QoQSimMethod's numbers on the CPU's INT8 GEMM (the fused VNNI kernel
    where it builds, else torch._int_mm), INT32 sums: what the quantizer's
    own passes run, faster than fp32 products.

    The simulation sums integers in fp32, exact while partial sums stay below
    2^24 (always for K <= 1024: 127 * 128 * K); both then give the same bits.
    Beyond that the INT32 sum is the exact one."""

    def process_weights_after_loading(self, layer: Linear) -> None:
        super().process_weights_after_loading(layer)
        # w_expanded holds integers: s2*(u - z) in -128..127, or the codes 0..15 per channel
        g = self.group_size
        self.gemm = integer_gemm(layer.w_expanded.to(torch.int8 if g else torch.uint8), layer.s1,
                                 None if g else layer.zeros, layer.bias if layer.has_bias else None)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x)


def integer_gemm(w: torch.Tensor, s1: torch.Tensor, zeros: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x @ (s1 * (w - z))^T on INT8 math (int8_linear's arguments): the
    fused C kernel where it builds, else torch's INT8 GEMM."""
    if w.device.type == "cpu" and fused_int8_available():
        return PackedInt8Gemm(w, s1, zeros, bias)
    return functools.partial(int8_linear, w_int8=w, s1=s1, zeros=zeros, bias=bias, cpu_ops=False)


def use_reference_simulation(model: nn.Module) -> None:
    """Turn the INT8-GEMM linears of model back into QoQSimMethod ones (same
    parameters; the products summed in fp32 again): the model the quantizer
    returns is the reference simulation."""
    for lin in model.modules():
        if isinstance(lin, Linear) and isinstance(lin.method, IntegerGemmSimMethod):
            lin.method = QoQSimMethod(lin.method.group_size)


def convert_to_qoq(layer: Linear, q, group_size: int) -> None:
    """Install QoQ parameters (QWeightGroup or QWeightChannel) on layer, sim
    backend on INT8 GEMMs (use_reference_simulation: on fp32 products)."""
    _swap_method(layer, IntegerGemmSimMethod(group_size))
    layer.qweight.data.copy_(qoq_ref.pack_uint4(q.u))
    layer.s1.data.copy_(q.s1)
    layer.zeros.data.copy_(q.z)
    if group_size:
        layer.s2.data.copy_(q.s2)
    layer.method.process_weights_after_loading(layer)


def convert_to_w8a8(layer: Linear, w: torch.Tensor) -> None:
    """Keep layer at W8A8 (SimW8A8Method); w is rounded to its fp16 storage."""
    _swap_method(layer, SimW8A8Method())
    layer.weight.data.copy_(w.half().float())
    layer.method.process_weights_after_loading(layer)


def convert_to_fake(layer: Linear, w_deq: torch.Tensor, quantize_activations: bool, label: str) -> None:
    _swap_method(layer, FakeQuantLinearMethod(quantize_activations, label))
    layer.weight.data.copy_(w_deq)
