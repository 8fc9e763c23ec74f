"""GPTQ error-compensating rounding (Frantar et al., 2022) for the QoQ formats.

Columns are quantized left to right; each column's rounding error is spread
over the not-yet-quantized columns through the Cholesky factor of H^-1, so
the layer output X W^T (not W itself) is what is preserved.
"""
from __future__ import annotations

import torch

from qoqserve.quant.weight_quantizer import WeightQuantizer


def gram(x: torch.Tensor, panel: int = 192) -> torch.Tensor:
    """x^T x [K, K] for x [T, K] in fp32, from its upper triangle only.

    torch exposes no symmetric rank-k product (BLAS syrk); row panels of the
    upper triangle (x[:, i:i+p]^T x[:, i:]), mirrored, skip most of the
    lower half's multiply-adds (docs/accuracy.md: quantization time)."""
    k = x.shape[1]
    if k <= panel:
        return x.t() @ x
    out = torch.empty(k, k, dtype=x.dtype, device=x.device)
    for i in range(0, k, panel):
        j = min(i + panel, k)
        out[i:j, i:] = x[:, i:j].t() @ x[:, i:]
        out[j:, i:j] = out[i:j, j:].t()
    return out


class HessianAccumulator:
    """Running H = 2/n * sum_t x_t^T x_t over all calibration tokens.

    Each batch's product is fp32, the running sum fp64 and normalized only when
    read, so many batches do not accumulate rounding error.
    """

    def __init__(self, k: int, device=None):
        self.sum = torch.zeros(k, k, dtype=torch.float64, device=device)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        # fp32 product per batch (fp64 matmul is ~5x slower on CPU), fp64 running sum
        x = x.reshape(-1, x.shape[-1]).float()
        self.sum += gram(x).double()
        self.n += x.shape[0]

    def hessian(self) -> torch.Tensor:
        if self.n == 0:
            raise ValueError("no calibration tokens were added")
        return (self.sum * (2.0 / self.n)).float()


class CrossAccumulator(HessianAccumulator):
    """Running G = 2/n * sum_t y_t^T x_t: the FP model's inputs y of a linear
    against the quantized model's inputs x, token by token (asymmetric
    calibration, `asymmetric_target`)."""

    def add_pair(self, y: torch.Tensor, x: torch.Tensor) -> None:
        self.sum += (y.t() @ x).double()
        self.n += x.shape[0]


def asymmetric_target(w: torch.Tensor, hessian: torch.Tensor, cross: torch.Tensor,
                      alpha: float = 1.0, percdamp: float = 0.01) -> torch.Tensor:
    """The weight W* whose outputs on the quantized model's inputs x best match
    the FP model's outputs on its own inputs y: argmin ||x W*^T - y W^T||^2
    = W G H^-1 with G = y^T x, H = x^T x. GPTQ on W* with H then minimizes that
    asymmetric objective (GPTAQ-style): ||x Q^T - y W^T||^2 = ||x (Q - W*)^T||^2
    + a constant. Written as W + alpha W (G - H) (H + damp I)^-1 so that the
    damping (GPTQ's) only shrinks the correction: where y = x, W* = W exactly.
    alpha < 1 takes part of the way: the whole least-squares correction grows
    with the drift of the deeper layers' inputs and fits the calibration text
    (GPTAQ scales its asymmetric term the same way, by 0.25)."""
    h = hessian.double()
    damped = h + percdamp * torch.diag(h).mean() * torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    # correction C = W (G - H) H_d^-1  <=>  H_d C^T = (G - H)^T W^T (H_d symmetric)
    rhs = (cross.double() - h).t() @ w.double().t()
    return (w.double() + alpha * torch.linalg.solve(damped, rhs).t()).to(w.dtype)


def _inverse_cholesky(h: torch.Tensor, percdamp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp*I)^-1, raising damping if H is too ill-posed."""
    k = h.shape[0]
    eye = torch.eye(k, dtype=h.dtype, device=h.device)
    damp = percdamp * torch.diag(h).mean()
    for _ in range(6):
        chol, info = torch.linalg.cholesky_ex(h + damp * eye)
        if int(info) == 0:
            hinv = torch.cholesky_inverse(chol)
            u, info = torch.linalg.cholesky_ex(hinv, upper=True)
            if int(info) == 0:
                return u
        damp = damp * 10 if damp > 0 else torch.tensor(1e-6, dtype=h.dtype)
    raise RuntimeError("Hessian is not positive definite even with heavy damping")


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, quantizer: WeightQuantizer,
                  block_size: int = 128, percdamp: float = 0.01, act_order: bool = False):
    """Quantize w [N, K] with GPTQ; returns (quantizer.result(), w_dequant fp32 [N, K]).

    `quantizer` must have been built from this same w (it owns s1 / z). Groups
    are dynamic (params taken from the compensated weights when their first
    column is reached) unless act_order, which would visit group members out of
    order: then groups are static, computed from the original w up front.
    """
    n, k = w.shape
    if hessian.shape != (k, k):
        raise ValueError(f"hessian must be [{k}, {k}], got {tuple(hessian.shape)}")
    g = quantizer.group_size
    if g and not act_order:
        # a group must lie inside one lazy-update block so that, when its params
        # are taken, all of its columns already carry the earlier errors
        block_size = max(block_size // g, 1) * g

    W = w.detach().float().clone()
    H = hessian.detach().to(torch.float64).clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1  # an input that is always 0: its weights are irrelevant, quantize 0
    W[:, dead] = 0

    if g and act_order:
        quantizer.prepare_all_groups(W)
    perm = torch.arange(k, device=W.device)
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
    perm_list = perm.tolist()

    U = _inverse_cholesky(H, percdamp).float()
    Q = torch.zeros_like(W)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = perm_list[i1 + i]
            if g and not act_order and col % g == 0:
                quantizer.prepare_group(col, W1[:, i:i + g])
            x = W1[:, i]
            q = quantizer.quant_dequant(col, x)
            Q[:, i1 + i] = q
            err = (x - q) / U1[i, i]
            # rank-1 update of the rest of this block only; later blocks get it in bulk
            W1[:, i:].addr_(err, U1[i, i:], alpha=-1)
            Err1[:, i] = err
        W[:, i2:].addmm_(Err1, U[i1:i2, i2:], alpha=-1)

    if act_order:
        Q = Q[:, torch.argsort(perm)]
    return quantizer.result(), Q
