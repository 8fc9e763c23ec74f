"""W4A8 linear methods for QoQ checkpoints (layout: docs/format.md).

One set of parameters (`QoQLinearMethod.create_weights`), one method per way
of executing it:
* `QoQSimMethod`: the fake-quant simulation; the INT8 x INT8 products are
  summed in fp32 (exact for integers below 2^24), so it is the reference for
  every integer path and fast enough for perplexity sweeps;
* `QoQInt8Method`: per-token INT8 activations times the INT8 weight expansion
  (INT32 accumulate), then the s_a * s1 epilogue. The expansion s2*(u - z) is
  done once at load and the packed codes are freed (1 byte per weight
  resident); with the fused C kernel it is repacked for it (int8_gemm.py),
  else torch._int_mm runs it;
* `QoQPerCallMethod`: the same GEMM, but only the packed codes stay resident
  (0.5 byte per weight) and each call expands them first;
* `QoQPackedMethod`: the CPU default: the codes stay 4-bit (repacked once at
  load for kernels/cpu/w4a8_gemm.c) and are unpacked and expanded in
  registers inside the VNNI loop, quantize and epilogue in the same call;
* `QoQTritonMethod`: the CUDA path. The packed codes stay resident and are
  expanded in registers inside the GEMM main loop; the input is quantized by
  a kernel fused with the RMSNorm or SiLU*mul that makes it.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from qoqserve.kernels import qoq_ref
from qoqserve.kernels.cpu import int8_linear as int8_kernel
from qoqserve.kernels.cpu import w4a8_gemm
from qoqserve.kernels.cpu.w4a8_gemm import NormInput, PackedW4A8Gemm, SiluMulInput
from qoqserve.layers.linear import Linear, LinearMethod, add_param
from qoqserve.layers.quantization.int8_gemm import install_packed_gemm, int8_linear
from qoqserve.layers.token_ops import CpuTokenOps


class QuantizedActivation(NamedTuple):
    """A per-token INT8 activation as the fused kernels hand it to the GEMM."""
    q: torch.Tensor       # int8 [M, K]
    scale: torch.Tensor   # fp32 [M]
    row_sum: torch.Tensor  # fp32 [M], of the unquantized rows (per-channel epilogue)
    dtype: torch.dtype    # of the unquantized activation: the GEMM's output dtype


def qoq_param_shapes(out_features: int, in_features: int, group_size: int) -> dict:
    """name -> (shape, dtype, inputs per element along dim 1 or None) of one
    quantized linear's checkpoint tensors."""
    n, k, g = out_features, in_features, group_size
    shapes = {"qweight": ((n, k // 2), torch.uint8, 2), "s1": ((n,), torch.float16, None)}
    if g:
        shapes["s2"] = ((n, k // g), torch.uint8, g)
        shapes["zeros"] = ((n, k // g), torch.uint8, g)
    else:
        shapes["zeros"] = ((n,), torch.uint8, None)
    return shapes


def int8_weight(layer: Linear, group_size: int) -> torch.Tensor:
    """The INT8 operand of the GEMM: s2*(u - z) per group, or u itself per channel."""
    u = qoq_ref.unpack_uint4(layer.qweight)
    if not group_size:
        return u.to(torch.int8)
    n, k = u.shape
    w = (u.view(n, k // group_size, group_size).to(torch.int16) - layer.zeros.to(torch.int16)[..., None])
    return (w * layer.s2.to(torch.int16)[..., None]).view(n, k).to(torch.int8)


class QoQLinearMethod(LinearMethod):
    """The parameters of a QoQ W4A8 linear; subclasses execute them."""
    backend = "abstract"

    def __init__(self, group_size: int, cpu_ops: bool = False, fused: bool = False):
        self.group_size = group_size
        self.cpu_ops = cpu_ops
        self.name = f"w4a8-{'g%d' % group_size if group_size else 'chn'}/{self.backend}"

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        k = layer.in_features
        if k % 2 or (self.group_size and k % self.group_size):
            raise ValueError(f"in_features {k} is not a multiple of the group size {self.group_size}")
        for name, (shape, pdtype, pack) in qoq_param_shapes(layer.out_features, k, self.group_size).items():
            param = add_param(layer, name, shape, pdtype, input_dim=None if pack is None else 1,
                              input_pack=pack or 1)
            param.exact_dtype = True  # stored as is: the kernels read these bytes
        if layer.has_bias:
            add_param(layer, "bias", (layer.out_features,), dtype)

    def input_alignment(self) -> int:
        return self.group_size or 2  # a byte holds two inputs' codes

    def process_weights_after_loading(self, layer: Linear) -> None:
        if self.group_size:
            s2, z = layer.s2.to(torch.int32), layer.zeros.to(torch.int32)
            lo, hi = int((s2 * -z).min()), int((s2 * (15 - z)).max())
            if lo < -128 or hi > 127:
                raise ValueError(f"s2*(u - z) leaves the INT8 range ({lo}..{hi}): corrupt s2/zeros")

    def _zeros(self, layer: Linear) -> torch.Tensor | None:
        """Per-channel zero points for the epilogue (group configs fold them into w)."""
        return None if self.group_size else layer.zeros

    def _bias(self, layer: Linear) -> torch.Tensor | None:
        return layer.bias if layer.has_bias else None


class QoQSimMethod(QoQLinearMethod):
    backend = "sim"

    def process_weights_after_loading(self, layer: Linear) -> None:
        super().process_weights_after_loading(layer)
        layer.register_buffer("w_expanded", int8_weight(layer, self.group_size).float(),
                              persistent=False)

    def apply(self, layer: Linear, x) -> torch.Tensor:
        if self.group_size:
            y = qoq_ref.w4a8_group_linear_sim(x, layer.w_expanded, layer.s1)
        else:
            y = qoq_ref.w4a8_channel_linear_sim(x, layer.w_expanded, layer.s1, layer.zeros)
        if layer.has_bias:
            y = y + layer.bias.float()
        return y.to(x.dtype)


class QoQInt8Method(QoQLinearMethod):
    backend = "torch-int8"

    def __init__(self, group_size: int, cpu_ops: bool = False, fused: bool = False):
        super().__init__(group_size, cpu_ops)
        self.fused = fused and cpu_ops
        if self.fused:
            self.name += int8_kernel.suffix()  # the fused C kernel, not the 3-pass path
        elif cpu_ops:
            self.name += "+c"

    def process_weights_after_loading(self, layer: Linear) -> None:
        super().process_weights_after_loading(layer)
        w = int8_weight(layer, self.group_size)
        del layer._parameters["qweight"]  # the expansion replaces the packed codes in memory
        if self.fused:
            install_packed_gemm(layer, w, layer.s1, self._zeros(layer), self._bias(layer))
        else:
            layer.register_buffer("w_expanded", w, persistent=False)

    def apply(self, layer: Linear, x) -> torch.Tensor:
        if self.fused:
            return layer.int8_gemm(x)
        return int8_linear(x, layer.w_expanded, layer.s1, self._zeros(layer), self._bias(layer),
                           self.cpu_ops)


class QoQPerCallMethod(QoQLinearMethod):
    backend = "torch-int8-percall"

    def __init__(self, group_size: int, cpu_ops: bool = False, fused: bool = False):
        super().__init__(group_size, cpu_ops)
        if cpu_ops:
            self.name += "+c"

    def apply(self, layer: Linear, x) -> torch.Tensor:
        return int8_linear(x, int8_weight(layer, self.group_size), layer.s1, self._zeros(layer),
                           self._bias(layer), self.cpu_ops)


class QoQPackedMethod(QoQLinearMethod):
    backend = "packed"

    def __init__(self, group_size: int, cpu_ops: bool = False, fused: bool = False):
        super().__init__(group_size, cpu_ops)
        # the path its calls take (capped by QOQSERVE_CPU_ISA; scalar on CPUs without AVX2)
        self.name += {"amx": "+amx", "avx512-vnni": "+vnni", "avx2": "+avx2"}.get(w4a8_gemm.isa(), "+scalar")

    def process_weights_after_loading(self, layer: Linear) -> None:
        super().process_weights_after_loading(layer)
        # a gate_up whose output only SiLU*mul reads (with the C token ops, whose rounding the
        # epilogue's is): stored in silu pairs, so one call makes silu(gate) * up
        pairs = (layer.silu_mul_after and self.cpu_ops and len(layer.output_sizes) == 2
                 and layer.output_sizes[0] == layer.output_sizes[1]
                 and w4a8_gemm.silu_pairs_supported(layer.out_features, self.group_size))
        layer.packed_w4a8 = PackedW4A8Gemm(layer.qweight, layer.s1, layer.s2 if self.group_size else None,
                                           layer.zeros, self._bias(layer), self.group_size, silu_pairs=pairs)
        for name in ("qweight", "s1", "s2", "zeros", "bias"):  # the kernel keeps its own copies
            layer._parameters.pop(name, None)

    def _fuses(self, ops) -> bool:
        # only where the fused row rounds as the model's own op (the C one) and
        # the epilogue needs no torch row sum of the input (group layouts)
        return bool(self.group_size) and isinstance(ops, CpuTokenOps) and not torch.compiler.is_compiling()

    def input_from_norm(self, norm, h, delta=None):
        if self._fuses(getattr(norm, "ops", None)) and NormInput.fits(h, delta, norm.weight):
            # h += delta happens in place when this layer runs, before anything reads h
            return NormInput(h, delta, norm.weight, norm.eps), h
        return super().input_from_norm(norm, h, delta)

    def input_from_silu_mul(self, gate_up, silu_mul):
        if self._fuses(getattr(silu_mul, "__self__", None)):
            return SiluMulInput(gate_up)
        return silu_mul(gate_up)

    def silu_mul_output(self, layer: Linear, x, silu_mul) -> torch.Tensor | None:
        if layer.packed_w4a8.silu_pairs and self._fuses(getattr(silu_mul, "__self__", None)):
            return layer.packed_w4a8.silu_mul(x)
        return None

    def apply(self, layer: Linear, x) -> torch.Tensor:
        return layer.packed_w4a8(x)


class QoQTritonMethod(QoQLinearMethod):
    backend = "triton"

    def input_from_norm(self, norm, h, delta=None):
        # lazy: Triton (imports triton, present only with it)
        from qoqserve.kernels.triton.ops import rmsnorm_quant
        if delta is not None:
            h = h + delta
        return QuantizedActivation(*rmsnorm_quant(h, norm.weight, norm.eps), h.dtype), h

    def input_from_silu_mul(self, gate_up, silu_mul):
        # lazy: Triton (imports triton, present only with it)
        from qoqserve.kernels.triton.ops import silu_mul_quant
        return QuantizedActivation(*silu_mul_quant(gate_up), gate_up.dtype)

    def apply(self, layer: Linear, x) -> torch.Tensor:
        # lazy: Triton (imports triton, present only with it)
        from qoqserve.kernels.triton.ops import quant_int8, w4a8_gemm
        if not isinstance(x, QuantizedActivation):  # o_proj's input: a standalone quant
            lead = x.shape[:-1]
            x = QuantizedActivation(*quant_int8(x.reshape(-1, x.shape[-1])), x.dtype)
        else:
            lead = x.q.shape[:-1]
        y = w4a8_gemm(x.q, x.scale, layer.qweight, layer.s1, layer.zeros,
                      layer.s2 if self.group_size else None, self.group_size, x.row_sum,
                      self._bias(layer), x.dtype)
        return y.reshape(*lead, -1)
