"""What the quantizer measures inside one decoder layer, via forward hooks."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from qoqserve.kernels.kv_ref import dequantize_kv4, quantize_kv4
from qoqserve.layers.token_ops import soft_cap
from qoqserve.quant.gptq import CrossAccumulator, HessianAccumulator
from qoqserve.quant.sim import fake_quant_act_int8
from qoqserve.quant.transforms.smooth import smooth_attention_lambda


class LayerCapture:
    """Input absmax per channel, a token subsample and (optionally) the GPTQ
    Hessian of each named linear, plus post-RoPE key statistics [Hkv, D].

    Use as a context manager around the layer's forward passes.
    """

    def __init__(self, layer, linear_names: Sequence[str], arch, hessians: bool,
                 sample_every: int = 16, skip_outputs: Sequence[str] = (),
                 targets: dict[str, torch.Tensor] | None = None):
        """skip_outputs: linears whose inputs are measured but whose outputs
        nothing measured depends on (the last one, mlp.down_proj): inside the
        context they return zeros instead of their product, so the layer's
        output is not its real one there.
        targets: per linear, the FP model's own inputs [T, K] for the same
        tokens, in the order the forward passes see them; they follow the
        linear's input permutations and scales, and with hessians their cross
        product with the inputs seen here is accumulated (self.cross)."""
        self.layer = layer
        self.names = list(linear_names)
        self.skip_outputs = list(skip_outputs)
        self.sample_every = sample_every
        self.absmax: dict[str, torch.Tensor] = {}
        self.samples: dict[str, torch.Tensor] = {}
        self._parts: dict[str, list[torch.Tensor]] = {n: [] for n in self.names}
        self.hessians = ({n: HessianAccumulator(layer.get_submodule(n).in_features)
                          for n in self.names} if hessians else {})
        self.targets = dict(targets or {})
        self.cross = {n: CrossAccumulator(layer.get_submodule(n).in_features)
                      for n in self.names if n in self.targets and hessians}
        # post-RoPE key range and mean: SmoothAttention and the KeyTransform shift
        self.key_min = torch.full((arch.num_kv_heads, arch.head_dim), float("inf"))
        self.key_max = torch.full((arch.num_kv_heads, arch.head_dim), float("-inf"))
        self._key_sum = torch.zeros(arch.num_kv_heads, arch.head_dim, dtype=torch.float64)
        self._key_count = 0
        # post-RoPE q / k token subsamples, for the SmoothAttention strength search
        self._qk_parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.q_sample = self.k_sample = self.v_sample = None
        self._handles = []

    def _linear_hook(self, name: str):
        def hook(module, args):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])
            amax = x.abs().amax(dim=0)
            prev = self.absmax.get(name)
            self.absmax[name] = amax if prev is None else torch.maximum(prev, amax)
            self._parts[name].append(x[::self.sample_every].clone())
            if name in self.hessians:
                self.hessians[name].add(x)
            if name in self.cross:
                acc = self.cross[name]
                acc.add_pair(self.targets[name][acc.n:acc.n + x.shape[0]], x)
        return hook

    def _key_hook(self, module, args):
        k = args[1].detach().float()  # [T, Hkv, D], after RoPE
        self.key_min = torch.minimum(self.key_min.to(k.device), k.amin(dim=0))
        self.key_max = torch.maximum(self.key_max.to(k.device), k.amax(dim=0))
        self._key_sum = self._key_sum.to(k.device) + k.double().sum(dim=0)
        self._key_count += k.shape[0]
        self._qk_parts.append((args[0].detach().float()[::4 * self.sample_every].clone(),
                               k[::self.sample_every].clone(),
                               args[2].detach().float()[::self.sample_every].clone()))

    @property
    def key_absmax(self) -> torch.Tensor:
        """[Hkv, D] absmax of the post-RoPE keys (what SmoothAttention smooths)."""
        return torch.maximum(self.key_max, -self.key_min)

    @property
    def key_mean(self) -> torch.Tensor:
        """[Hkv, D] mean post-RoPE key over the calibration tokens."""
        return (self._key_sum / max(self._key_count, 1)).float()

    def centered_key_absmax(self) -> torch.Tensor:
        """[Hkv, D] absmax of (k - key_mean): what is left for the 4-bit codes."""
        mean = self.key_mean
        return torch.maximum(self.key_max - mean, mean - self.key_min)

    def __enter__(self):
        for name in self.names:
            self._handles.append(self.layer.get_submodule(name).register_forward_pre_hook(
                self._linear_hook(name)))
        self._handles.append(self.layer.self_attn.attn.register_forward_pre_hook(self._key_hook))
        for name in self.skip_outputs:
            lin = self.layer.get_submodule(name)
            # an instance attribute shadows Linear.forward; the pre-hooks above still run
            lin.forward = lambda x, n=lin.out_features: x.new_zeros(*x.shape[:-1], n)
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for name in self.skip_outputs:
            del self.layer.get_submodule(name).forward
        for name, parts in self._parts.items():
            if parts:
                self.samples[name] = torch.cat(parts)
        self._parts = {n: [] for n in self.names}
        if self._qk_parts:
            self.q_sample, self.k_sample, self.v_sample = (torch.cat(t) for t in zip(*self._qk_parts))
        self._qk_parts = []
        return False


    def permute_inputs(self, name: str, perm: torch.Tensor) -> None:
        """The linear's inputs were reordered: new channel i is old channel perm[i]."""
        self.absmax[name] = self.absmax[name][perm]
        self.samples[name] = self.samples[name][:, perm]
        for acc in (self.hessians.get(name), self.cross.get(name)):
            if acc is not None:
                acc.sum = acc.sum[perm][:, perm]
        if name in self.targets:
            self.targets[name] = self.targets[name][:, perm]

    def scale_inputs(self, name: str, factor: torch.Tensor) -> None:
        """The linear's input channel j is now multiplied by factor[j]."""
        f = factor.to(self.samples[name].device)
        self.absmax[name] = self.absmax[name] * f.float()
        self.samples[name] = self.samples[name] * f.float()
        for acc in (self.hessians.get(name), self.cross.get(name)):
            if acc is not None:  # both the FP and the quantized inputs are rescaled
                acc.sum = acc.sum * f.double()[:, None] * f.double()[None, :]
        if name in self.targets:
            self.targets[name] = self.targets[name] * f.float()


def search_alpha(x: torch.Tensor, w: torch.Tensor, grid: Sequence[float],
                 quant_w: Callable[[torch.Tensor], torch.Tensor], quant_act: bool,
                 scales_for: Callable[[float], torch.Tensor]) -> float:
    """Migration strength minimising ||x w^T - Q(x / s) Q(w * s)^T||^2 on the sample."""

    x, w = x.float(), w.float()
    ref = x @ w.t()
    best, best_err = None, float("inf")
    for alpha in grid:
        s = scales_for(alpha).float()
        xs = x / s
        if quant_act:
            xs = fake_quant_act_int8(xs)
        err = float((xs @ quant_w(w * s).t() - ref).square().sum())
        if err < best_err:
            best, best_err = alpha, err
    return float(best)


def search_key_alpha(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Sequence[float],
                     key_absmax: torch.Tensor, key_mean: torch.Tensor | None = None,
                     rotation: torch.Tensor | None = None, max_q: int = 512, max_k: int = 2048,
                     rotary: int | None = None, scale: float | None = None, softcap: float = 0.0) -> float:
    """SmoothAttention strength (0 = none) minimising the attention-output error
    ||softmax(q K^T) V - softmax(q K4^T) V|| over sampled queries and keys, with
    K4 the keys as the cache would hold them: smoothed by lambda, then (with
    key_mean and rotation) centered and rotated, then KV4 round-tripped.
    Output error, not score error: it weighs the keys that get attention.
    q [Tq, H, D], k / v [Tk, Hkv, D] post-RoPE; key_absmax [Hkv, D] feeds lambda;
    rotary: the channels RoPE turns (smooth_attention_lambda); scale, softcap:
    the model's score scale (None: head_dim ** -0.5) and soft cap (Gemma 2)."""

    q = q[torch.linspace(0, q.shape[0] - 1, min(max_q, q.shape[0])).long()].float()
    pick = torch.linspace(0, k.shape[0] - 1, min(max_k, k.shape[0])).long()
    k, v = k[pick].float(), v[pick].float()
    hkv, d = k.shape[1], k.shape[2]
    g = q.shape[1] // hkv
    vh = v.transpose(0, 1)                                      # [Hkv, Tk, D]

    def attend(qs, ks):  # [Tq, H, D] x [Tk, Hkv, D] -> [Hkv, Tq*g, D]
        qh = qs.reshape(-1, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, -1, d)
        scores = qh @ ks.permute(1, 2, 0) * (scale or d ** -0.5)
        return torch.softmax(soft_cap(scores, softcap) if softcap else scores, dim=-1) @ vh

    ref = attend(q, k)
    best, best_err = None, float("inf")
    for alpha in grid:
        lam = smooth_attention_lambda(key_absmax, alpha, rotary).float().to(k.device)
        ks, qs = k / lam, q * lam.repeat_interleave(g, dim=0)
        if rotation is not None:
            r = rotation.float().to(k.device)
            ks, qs = (ks - key_mean.float().to(k.device) / lam) @ r, qs @ r
        k4 = dequantize_kv4(*quantize_kv4(ks), torch.float32)
        err = float((attend(qs, k4) - ref).square().sum())
        if err < best_err:
            best, best_err = alpha, err
    return float(best)
