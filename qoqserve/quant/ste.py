"""What the quantizer's training loops (the learned rotation, scale tuning)
share: straight-through fake quantization (the value is the quantized one,
the gradient goes to the unquantized input, plus the rounding error in steps
to the step size, LSQ-style, so the loss also sees what sets each range), and
the loss both minimize against the FP model."""
from __future__ import annotations

from typing import Callable

import torch

from qoqserve.quant import sim


def kl_to_reference(ref_logprobs: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Mean per-token KL(P_FP || P_model): the FP model's log-probabilities
    against the model's logits, both [tokens, vocab]."""
    ref = ref_logprobs.float()
    return (ref.exp() * (ref - torch.log_softmax(logits.float(), -1))).sum(-1).mean()


def ste(x: torch.Tensor, xq: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    return x + step * ((xq - x) / step).detach()


def act_int8(x: torch.Tensor) -> torch.Tensor:
    """Per-token symmetric INT8, as every W4A8/W8A8 linear's input."""
    step = (x.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-12)
    return ste(x, sim.fake_quant_act_int8(x.detach()), step)


class KVFakeQuant:
    """Stands in for an attention layer's KV layout while training: its fake
    quantization with a straight-through gradient while `active()`, else the
    exact values (layout None: a layout that does not quantize)."""

    def __init__(self, layout, active: Callable[[], bool]):
        self.layout, self.active = layout, active

    def fake_quant(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout is None or not self.active():
            return x
        step = ((x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / 15).clamp_min(1e-8)
        return ste(x, self.layout.fake_quant(x.detach()), step)
