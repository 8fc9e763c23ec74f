"""What the quantizer measures inside one decoder layer, via forward hooks."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from qoqserve.quant.gptq import HessianAccumulator


class LayerCapture:
    """Input absmax per channel, a token subsample and (optionally) the GPTQ
    Hessian of each named linear, plus the post-RoPE key absmax [Hkv, D].

    Use as a context manager around the layer's forward passes.
    """

    def __init__(self, layer, linear_names: Sequence[str], arch, hessians: bool,
                 sample_every: int = 16):
        self.layer = layer
        self.names = list(linear_names)
        self.sample_every = sample_every
        self.absmax: dict[str, torch.Tensor] = {}
        self.samples: dict[str, torch.Tensor] = {}
        self._parts: dict[str, list[torch.Tensor]] = {n: [] for n in self.names}
        self.hessians = ({n: HessianAccumulator(layer.get_submodule(n).in_features)
                          for n in self.names} if hessians else {})
        self.key_absmax = torch.zeros(arch.num_kv_heads, arch.head_dim)
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
        return hook

    def _key_hook(self, module, args):
        k = args[1].detach().float()  # [T, Hkv, D], after RoPE
        self.key_absmax = torch.maximum(self.key_absmax.to(k.device), k.abs().amax(dim=0))

    def __enter__(self):
        for name in self.names:
            self._handles.append(self.layer.get_submodule(name).register_forward_pre_hook(
                self._linear_hook(name)))
        self._handles.append(self.layer.self_attn.attn.register_forward_pre_hook(self._key_hook))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for name, parts in self._parts.items():
            if parts:
                self.samples[name] = torch.cat(parts)
        self._parts = {n: [] for n in self.names}
        return False


    def permute_inputs(self, name: str, perm: torch.Tensor) -> None:
        """The linear's inputs were reordered: new channel i is old channel perm[i]."""
        self.absmax[name] = self.absmax[name][perm]
        self.samples[name] = self.samples[name][:, perm]
        if name in self.hessians:
            acc = self.hessians[name]
            acc.sum = acc.sum[perm][:, perm]

    def scale_inputs(self, name: str, factor: torch.Tensor) -> None:
        """The linear's input channel j is now multiplied by factor[j]."""
        f = factor.to(self.samples[name].device)
        self.absmax[name] = self.absmax[name] * f.float()
        self.samples[name] = self.samples[name] * f.float()
        if name in self.hessians:
            acc = self.hessians[name]
            acc.sum = acc.sum * f.double()[:, None] * f.double()[None, :]


def search_alpha(x: torch.Tensor, w: torch.Tensor, grid: Sequence[float],
                 quant_w: Callable[[torch.Tensor], torch.Tensor], quant_act: bool,
                 scales_for: Callable[[float], torch.Tensor]) -> float:
    """Migration strength minimising ||x w^T - Q(x / s) Q(w * s)^T||^2 on the sample."""
    from qoqserve.quant.sim import fake_quant_act_int8

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
