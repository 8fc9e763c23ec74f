"""A learned residual rotation (SpinQuant / OSTQuant style), trained from the
Hadamard start against the fake-quantized model.

On the norm-folded fp32 model, R [hidden, hidden] is optimized so that the
model whose residual stream is rotated by R (readers W R, writers R^T W,
embeddings E R: what rotate_model folds) and then run with QoQ
round-to-nearest W4 weights and per-token INT8 linear inputs (optionally KV4)
matches the FP model's next-token distribution (KL) or the text (CE).

Orthogonality by construction: R = Q0 C(A), C(A) = (I - A)^-1 (I + A) the
Cayley transform of a skew-symmetric A = B - B^T, in float64. Any B gives an
exactly orthogonal R (to fp64 rounding), B = 0 is the Hadamard Q0, and plain
Adam on B needs no Stiefel-manifold optimizer (SpinQuant's Cayley SGD moves
on the manifold with the same transform; here it is the parametrization).

The model runs through its own decoder layers (one source of the forward
math): each linear's method is swapped, for the training only, for one that
rotates and fake-quantizes its weight on the fly, so gradients reach R.
Rounding passes gradients straight through, plus the rounding error
normalized by the step size through the step (range / levels), which is
what lets the loss see the outliers that set each range.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from qoqserve.layers.attention import AttentionMetadata
from qoqserve.layers.linear import Linear, LinearMethod
from qoqserve.layers.token_ops import soft_cap
from qoqserve.quant import sim
from qoqserve.quant.config import QuantConfig
from qoqserve.quant.hadamard import orthogonal_matrix
from qoqserve.quant.ste import HeadKL, KVFakeQuant, act_int8, head_kl_buffers, ste

# which side of the residual stream each linear of a layer touches
READERS = ("self_attn.qkv_proj", "mlp.gate_up_proj")
WRITERS = ("self_attn.o_proj", "mlp.down_proj")


def cayley(b: torch.Tensor) -> torch.Tensor:
    """(I - A)^-1 (I + A) with A = b - b^T: orthogonal for any b, I at b = 0."""
    a = b - b.T
    eye = torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
    return torch.linalg.solve(eye - a, eye + a)


def _weight_step(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """A differentiable stand-in for the QoQ W4 step of each weight: its
    group's (or row's) range over 15 levels (the two-level integer scales
    round it, the gradient does not need that)."""
    n, k = w.shape
    g = group_size or k
    wg = w.reshape(n, k // g, g)
    step = (wg.amax(-1, keepdim=True) - wg.amin(-1, keepdim=True)).clamp_min(1e-8) / 15
    return step.expand(n, k // g, g).reshape(n, k)


@dataclass
class _State:
    """What the swapped methods read at each forward."""
    r: torch.Tensor | None = None   # fp32 R, or None: the unrotated FP model
    quantize: bool = False
    act_quant: bool = True
    kv_quant: bool = False
    group_size: int = 64


class _RotatedFakeQuant(LinearMethod):
    name = "learned-rotation-train"

    def __init__(self, state: _State, reader: bool):
        self.state, self.reader = state, reader

    def create_weights(self, layer, dtype) -> None:  # wraps a built layer's weight
        raise NotImplementedError

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        st, w = self.state, layer.weight
        b = layer.bias if layer.has_bias else None
        if st.r is not None:
            w = w @ st.r if self.reader else st.r.T @ w
            if b is not None and not self.reader:
                b = b @ st.r
        if st.quantize:
            w = ste(w, sim.qoq_rtn(w.detach(), st.group_size), _weight_step(w, st.group_size))
            if st.act_quant:
                x = act_int8(x)
        return F.linear(x, w, b)


@contextlib.contextmanager
def _training_methods(model, state: _State):
    """Every decoder linear on a _RotatedFakeQuant, every attention on an
    exact-or-STE KV path, for the duration; restored after."""
    saved = []
    for layer in model.layers:
        for names, reader in ((READERS, True), (WRITERS, False)):
            for name in names:
                lin = layer.get_submodule(name)
                saved.append((lin, "method", lin.method))
                lin.method = _RotatedFakeQuant(state, reader)
        attn = layer.self_attn.attn
        saved.append((attn, "layout", attn.layout))
        attn.layout = KVFakeQuant(attn.layout if attn.backend.quantized_prefill else None,
                                  lambda: state.quantize and state.kv_quant)
    try:
        yield
    finally:
        for obj, attr, value in saved:
            setattr(obj, attr, value)


def _hidden(model, ids: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
    """[B, L] token ids -> [B*L, hidden]: the final hidden states of the model
    with its residual stream rotated by r (the layers' methods do the rest),
    rotated back: the unquantized LM head reads the rotated stream as
    (x R^T) L^T, so it is never rotated."""
    b, n = ids.shape
    h = F.embedding(ids.reshape(-1), model.embed_tokens)
    if r is not None:
        h = h @ r
    meta = AttentionMetadata(True, None, None, None, [i * n for i in range(b + 1)], [0] * b)
    positions = torch.arange(n, device=ids.device).repeat(b)
    delta = None
    for layer in model.layers:
        h, delta = layer(positions, h, meta, None, delta)
    x = model.norm(h, delta)[0]
    return x @ r.T if r is not None else x


@dataclass
class LearnedRotation:
    r: torch.Tensor                      # float64 [hidden, hidden], orthogonal
    curve: list[float] = field(default_factory=list)  # training loss per step
    start_loss: float = math.nan         # on the whole training set, at Q0
    end_loss: float = math.nan           # same, at R
    seconds: float = 0.0


class RotationTrainer:
    """Trains R on `windows` ([S, L] token ids) of a norm-folded fp32 model."""

    def __init__(self, model, windows: torch.Tensor, cfg: QuantConfig, q0: torch.Tensor | None = None):
        self.model, self.windows, self.cfg = model, windows, cfg
        if q0 is None:
            q0 = orthogonal_matrix(model.cfg.hidden_size, cfg.seed, dtype=torch.float64)
        self.q0 = q0.double().to(model.embed_tokens.device)
        self.b = nn.Parameter(torch.zeros_like(self.q0))
        self.state = _State(act_quant=cfg.rotation_act_quant, kv_quant=cfg.rotation_kv_quant,
                            group_size=cfg.group_size)
        self._ref: list[torch.Tensor | None] = [None] * len(windows)
        self.head_grad = self.work = None  # HeadKL's, for the KL loss
        if cfg.rotation_loss == "kl":
            self.head_grad, self.work = head_kl_buffers(model.lm_head, cfg.rotation_batch * windows.shape[1])

    def rotation(self) -> torch.Tensor:
        return self.q0 @ cayley(self.b)

    def _ref_hidden(self, i: int) -> torch.Tensor:
        """The FP model's final hidden states of window i, kept (S*L*hidden floats)."""
        if self._ref[i] is None:
            self.state.r, self.state.quantize = None, False
            with torch.no_grad():
                self._ref[i] = _hidden(self.model, self.windows[i:i + 1], None)
        return self._ref[i]

    def batch_loss(self, idx: list[int], r: torch.Tensor) -> torch.Tensor:
        """Fake-quant loss of the model rotated by r (float64) on windows idx."""
        kl = self.cfg.rotation_loss == "kl"
        ref = torch.cat([self._ref_hidden(i) for i in idx]) if kl else None
        self.state.r, self.state.quantize = r.float(), True
        hidden, head = _hidden(self.model, self.windows[idx], self.state.r), self.model.lm_head
        cap = self.model.cfg.logit_softcap or 0.0
        if kl:
            return HeadKL.apply(hidden, ref, head, head, self.head_grad, self.work, cap)
        ids = self.windows[idx]
        logits = F.linear(hidden, head).float()
        if cap:
            logits = soft_cap(logits, cap)
        lp = torch.log_softmax(logits, -1).view(*ids.shape, -1)[:, :-1]
        return F.nll_loss(lp.reshape(-1, lp.shape[-1]), ids[:, 1:].reshape(-1))

    def evaluate(self, r: torch.Tensor) -> float:
        """The mean loss over every training window (no gradients)."""
        with torch.no_grad(), _training_methods(self.model, self.state):
            return sum(float(self.batch_loss([i], r)) for i in range(len(self.windows))) / len(self.windows)

    def train(self, steps: int | None = None, progress: bool = False) -> LearnedRotation:
        cfg, start = self.cfg, time.perf_counter()
        steps = cfg.rotation_steps if steps is None else steps
        opt = torch.optim.Adam([self.b], lr=cfg.rotation_lr)
        decay = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda i: 1 - i / steps if cfg.rotation_lr_decay else 1.0)
        gen = torch.Generator().manual_seed(cfg.seed)
        order: list[int] = []
        curve = []
        with _training_methods(self.model, self.state):
            for step in range(steps):
                if len(order) < cfg.rotation_batch:  # epochs over the windows, shuffled
                    order += torch.randperm(len(self.windows), generator=gen).tolist()
                idx, order = order[:cfg.rotation_batch], order[cfg.rotation_batch:]
                loss = self.batch_loss(idx, self.rotation())
                opt.zero_grad()
                loss.backward()
                opt.step()
                decay.step()
                curve.append(float(loss.detach()))
                if progress:
                    print(f"learned rotation step {step + 1}/{steps}: loss {curve[-1]:.4f} "
                          f"({time.perf_counter() - start:.0f}s)", file=sys.stderr, flush=True)
        with torch.no_grad():
            r = self.rotation().detach()
        return LearnedRotation(r, curve, seconds=time.perf_counter() - start)


def training_windows(samples: list[list[int]], cfg: QuantConfig, device: str = "cpu") -> torch.Tensor:
    """rotation_samples of the calibration windows, evenly spread, cut to
    their first rotation_seq_len tokens: [S, L]."""
    n = min(cfg.rotation_samples, len(samples))
    step = len(samples) / n
    rows = [samples[int(i * step)][:cfg.rotation_seq_len] for i in range(n)]
    return torch.tensor(rows, device=device)


def learn_rotation(model, samples: list[list[int]], cfg: QuantConfig, progress: bool = False,
                   evaluate: bool = False) -> LearnedRotation:
    """R for rotate_model (model: norm-folded fp32, left as it was).
    evaluate: also the loss over all training windows at Q0 and at R."""
    trainer = RotationTrainer(model, training_windows(samples, cfg, model.embed_tokens.device), cfg)
    start = trainer.evaluate(trainer.q0) if evaluate else math.nan
    with torch.enable_grad():
        result = trainer.train(progress=progress)
    if evaluate:
        result.start_loss, result.end_loss = start, trainer.evaluate(result.r)
    if progress:
        print(f"learned rotation: {cfg.rotation_steps} steps in {result.seconds:.0f}s, "
              f"loss {result.curve[0]:.4f} -> {result.curve[-1]:.4f}", file=sys.stderr)
    return result
