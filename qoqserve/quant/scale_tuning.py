"""End-to-end tuning of a quantized model's float scales against the FP model.

GPTQ and the group search fit each linear to its own inputs, one layer at a
time; what they leave is an error that piles up over the layers and that no
layer-local fit sees. Here every integer code stays as it is and only what
the checkpoint stores in float moves (EfficientQAT's end-to-end step, on
scales only): each QoQ linear's per-output-channel scale s1 and each RMSNorm
weight, as s * (1 + theta), trained with Adam on the KL divergence of the
fake-quantized model's next-token distribution to the FP model's, over the
calibration windows (per-token INT8 inputs and KV4 with straight-through
gradients: quant/ste.py). The checkpoint format is unchanged.

Linears kept at W8A8 by a mixed recipe pass gradients but are not tuned.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from qoqserve.kernels import qoq_ref
from qoqserve.layers.attention import AttentionMetadata
from qoqserve.layers.linear import Linear, LinearMethod
from qoqserve.layers.norm import RMSNorm
from qoqserve.layers.quantization.qoq_methods import QoQSimMethod
from qoqserve.quant import sim
from qoqserve.quant.sim import SimW8A8Method
from qoqserve.quant.ste import HeadKL, KVFakeQuant, act_int8, grad_dtype, head_kl_buffers


class _IntegerProduct(torch.autograd.Function):
    """act_int8(x) @ W^T for a linear's signed INT8 weight W: forward on the
    INT8 GEMM, which quantizes x per token itself and sums exactly what the
    fp32 simulation sums (IntegerGemmSimMethod); backward as act_int8's
    straight-through gradient (identity, plus the rounding error's share of
    the step, which reaches x at its largest |x|), with grad @ W in
    ste.grad_dtype() (bf16 where it is fast: W's integers are exact in it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, gemm, w_grad: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.w = w_grad
        return gemm(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        gx = (grad.to(ctx.w.dtype) @ ctx.w).float()
        amax = x.abs().amax(-1, keepdim=True)
        step = amax / 127
        r = sim.fake_quant_act_int8(x).sub_(x).div_(step.clamp_min(1e-12))  # (xq - x) / step
        at_max = (x.abs() == amax) & (step > 1e-12)
        share = (gx * r).sum(-1, keepdim=True) / (127 * at_max.sum(-1, keepdim=True).clamp_min(1))
        return gx.addcmul_(at_max * x.sign(), share), None, None


class _TunedQoQ(LinearMethod):
    """A QoQ linear of the reference simulation with s1 * (1 + theta) and a
    straight-through INT8 input (training only)."""
    name = "scale-tuning"

    def __init__(self, layer: Linear, group_size: int, theta: nn.Parameter):
        self.group_size, self.theta = group_size, theta
        # the INT8 GEMM with unit scales (s1 * (1 + theta) is applied after it)
        # over s2*(u - z) per group, or the codes u per channel
        w = layer.w_expanded
        self.gemm = sim.integer_gemm(w.to(torch.int8), torch.ones(layer.out_features, device=w.device))
        self.w_grad = w.to(grad_dtype())

    def create_weights(self, layer, dtype) -> None:  # wraps a built layer
        raise NotImplementedError

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        s1 = layer.s1.float() * (1 + self.theta)
        y = _IntegerProduct.apply(x, self.gemm, self.w_grad) * s1
        if not self.group_size:  # per channel: codes 0..15 around a zero point
            y = y - qoq_ref.act_row_sum(x)[..., None] * (layer.zeros.float() * s1)
        return y + layer.bias.float() if layer.has_bias else y


class _PassW8A8(LinearMethod):
    """A linear kept at W8A8: its numbers, with a straight-through input."""
    name = "scale-tuning-w8a8"

    def create_weights(self, layer, dtype) -> None:
        raise NotImplementedError

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(act_int8(x), layer.w_codes) * layer.w_scale.float()
        return y + layer.bias.float() if layer.has_bias else y


@dataclass
class ScaleTuning:
    curve: list[float] = field(default_factory=list)  # KL per step
    seconds: float = 0.0
    tuned: int = 0                                    # scales tuned (channels + norm weights)


@contextlib.contextmanager
def _tuning(model, tune_norms: bool):
    """The model's QoQ linears on _TunedQoQ, its KV4 on a straight-through path
    and (tune_norms) its RMSNorm weights taken out, to be set each step from
    (norm, weight, theta); yields the (scale, theta) pairs of the linears and
    those triples. Restored after; the caller writes the result."""
    saved, linears, norms = [], [], []
    try:  # what was swapped before a refused linear is put back too
        for lin in model.modules():
            if isinstance(lin, Linear) and type(lin.method) is QoQSimMethod:
                theta = nn.Parameter(torch.zeros(lin.out_features, device=lin.s1.device))
                saved.append((lin, "method", lin.method))
                lin.method = _TunedQoQ(lin, lin.method.group_size, theta)
                linears.append((lin.s1, theta))
            elif isinstance(lin, Linear) and isinstance(lin.method, SimW8A8Method):
                saved.append((lin, "method", lin.method))
                lin.method = _PassW8A8()
            elif isinstance(lin, Linear):
                raise ValueError(f"scale tuning runs on QoQ simulation models, not {lin.method.name} linears")
        for norm in [m for m in model.modules() if isinstance(m, RMSNorm)] if tune_norms else []:
            weight = norm._parameters.pop("weight")
            norms.append((norm, weight, nn.Parameter(torch.zeros_like(weight, dtype=torch.float32))))
        for layer in model.layers:
            attn = layer.self_attn.attn
            saved.append((attn, "layout", attn.layout))
            attn.layout = KVFakeQuant(attn.layout if attn.backend.quantized_prefill else None, lambda: True)
        yield linears, norms
    finally:
        for norm, weight, _ in norms:
            norm.__dict__.pop("weight", None)
            norm.register_parameter("weight", weight)
        for obj, attr, value in saved:
            setattr(obj, attr, value)


def _hidden(model, ids: list[int]) -> torch.Tensor:
    """The final hidden states of the tokens that predict a next one."""
    device = model.embed_tokens.device
    n = len(ids)
    meta = AttentionMetadata(True, None, None, None, [0, n], [0])
    return model(torch.tensor(ids, device=device), torch.arange(n, device=device), meta, None)[:-1]


def spread_windows(samples: list[list[int]], n: int) -> list[list[int]]:
    """n of the calibration windows, evenly spaced over them (the text's topics
    come one after another), in order; all of them when n is 0 or not fewer."""
    if n <= 0 or n >= len(samples):
        return list(samples)
    return [samples[i * len(samples) // n] for i in range(n)]


def tune_scales(model, teacher, samples: list[list[int]], epochs: int, lr: float, tune_norms: bool = True,
                seed: int = 0, progress: bool = False) -> ScaleTuning:
    """Tune `model` (a QoQ reference simulation, in place) toward `teacher`
    (the FP model) over `epochs` passes of the calibration windows, one
    window a step in a seeded order, the learning rate on a cosine to 0."""
    start, result = time.perf_counter(), ScaleTuning()
    steps = epochs * len(samples)
    gen = torch.Generator().manual_seed(seed)
    bar = tqdm(total=steps, desc="scale tuning", unit="window", disable=not progress)
    with _tuning(model, tune_norms) as (linears, norms), torch.enable_grad(), bar:
        pairs = linears + [(weight, theta) for _, weight, theta in norms]
        params = [theta for _, theta in pairs]
        result.tuned = sum(p.numel() for p in params)
        opt = torch.optim.Adam(params, lr=lr)
        decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5 * (1 + math.cos(math.pi * i / steps)))
        ref: dict[int, torch.Tensor] = {}  # the FP model's hidden states, once per window
        head_grad, work = head_kl_buffers(model.lm_head, max(map(len, samples)))
        for _ in range(epochs):
            for i in torch.randperm(len(samples), generator=gen).tolist():
                if i not in ref:
                    with torch.no_grad():
                        ref[i] = _hidden(teacher, samples[i])
                for norm, weight, theta in norms:  # a plain attribute while its parameter is out
                    norm.weight = weight.float() * (1 + theta)
                loss = HeadKL.apply(_hidden(model, samples[i]), ref[i] if epochs > 1 else ref.pop(i),
                                    model.lm_head, teacher.lm_head, head_grad, work, model.cfg.logit_softcap or 0.0)
                opt.zero_grad()
                loss.backward()
                opt.step()
                decay.step()
                result.curve.append(float(loss.detach()))
                bar.update()
                bar.set_postfix_str(f"KL {result.curve[-1]:.4f}")
        with torch.no_grad():
            for base, theta in pairs:  # s1 and norm weights keep their dtypes
                base.copy_((base.float() * (1 + theta)).to(base.dtype))
    result.seconds = time.perf_counter() - start
    return result
