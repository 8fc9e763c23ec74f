"""What the quantizer's training loops (the learned rotation, scale tuning)
share: straight-through fake quantization (the value is the quantized one,
the gradient goes to the unquantized input, plus the rounding error in steps
to the step size, LSQ-style, so the loss also sees what sets each range), and
the loss both minimize against the FP model."""
from __future__ import annotations

from typing import Callable

import torch

from qoqserve.kernels.cpu import isa
from qoqserve.quant import sim


def grad_dtype() -> torch.dtype:
    """The dtype of the backward's products with integer weights (exact in
    bf16): bf16 where torch's bf16 GEMM has vector kernels, else fp32."""
    return torch.bfloat16 if isa.torch_has_avx512_kernels() else torch.float32


HEAD_ROWS = 256  # tokens per block of HeadKL: fp32 GEMMs of 256 rows run near torch's full rate


def head_kl_buffers(head: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HeadKL's head_grad and work for an LM head and calls of up to `tokens` tokens."""
    head = head.detach()
    return head.to(grad_dtype()), torch.empty(3, min(HEAD_ROWS, tokens), head.shape[0], device=head.device)


class HeadKL(torch.autograd.Function):
    """Mean per-token KL(P_FP || P_model) of the LM head's next-token
    distributions from two models' final hidden states, h [T, hidden]
    (trained) and h_ref (the FP model's; head_ref its LM head), with its
    gradient for h made in the same pass, a block of tokens at a time: the
    [T, vocab] logits, log-probabilities and their gradient never exist whole
    (at 512 tokens x 49k words each is a fresh 100 MB tensor, whose page faults
    cost more than its arithmetic). work: [3, rows, vocab] fp32, reused from
    call to call; head_grad: head in the dtype of the gradient's product
    (grad_dtype(): bf16 halves its time where torch has the kernels).
    cap > 0: both models' logits soft-capped at it (Gemma 2), as the model's
    compute_logits does."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, h_ref: torch.Tensor, head: torch.Tensor, head_ref: torch.Tensor,
                head_grad: torch.Tensor, work: torch.Tensor, cap: float = 0.0) -> torch.Tensor:
        n_tok, rows = h.shape[0], work.shape[1]
        head_t, head_ref_t = head.float().t(), head_ref.float().t()
        grad, total = torch.empty(h.shape, dtype=torch.float32, device=h.device), 0.0
        for r0 in range(0, n_tok, rows):
            n = min(rows, n_tok - r0)
            a, b, p = work[0, :n], work[1, :n], work[2, :n]
            torch.mm(h_ref[r0:r0 + n].float(), head_ref_t, out=a)
            if cap:
                a.div_(cap).tanh_().mul_(cap)
            a.sub_(a.amax(-1, keepdim=True))
            torch.exp(a, out=p)
            norm = p.sum(-1, keepdim=True)
            p.div_(norm)                       # P_FP
            a.sub_(norm.log_())                # log P_FP
            torch.mm(h[r0:r0 + n].float(), head_t, out=b)
            if cap:
                b.div_(cap).tanh_().mul_(cap)
            top = b.amax(-1, keepdim=True)
            b.sub_(top)                        # log P + log sum exp(b)
            total += float(torch.dot(p.view(-1), a.sub_(b).view(-1)))
            torch.exp(b, out=a)
            norm = a.sum(-1, keepdim=True)
            total += float(norm.log().sum())   # sum P_FP = 1 per token
            g = a.div_(norm).sub_(p)           # d KL / d logits = P - P_FP
            if cap:  # through the cap: d (cap tanh(z / cap)) / dz = 1 - tanh^2
                g.mul_(b.add_(top).div_(cap).square_().neg_().add_(1))
            if head_grad.dtype != g.dtype:     # into b's memory, free now
                g = b.view(head_grad.dtype)[:, :g.shape[1]].copy_(g)
            grad[r0:r0 + n] = g @ head_grad
        ctx.save_for_backward(grad.div_(n_tok))
        return h.new_tensor(total / n_tok, dtype=torch.float32)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return grad * g, None, None, None, None, None, None


def ste(x: torch.Tensor, xq: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """xq, bit for bit, with the gradient of x + step * sg((xq - x) / step).
    That expression alone lands a last bit off xq on a third of the values,
    and per-token INT8 turns such bits into whole steps downstream, so the
    training would not see the model the simulation scores. y is within a few
    ulps of xq, so xq - y is exact (Sterbenz) and y + (xq - y) is xq."""
    y = x + step * ((xq - x) / step).detach()
    return y + (xq - y).detach()


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
