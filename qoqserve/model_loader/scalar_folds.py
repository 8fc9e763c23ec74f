"""What is folded into a checkpoint's weights as they are read.

Gemma's RMSNorm weights are stored as w - 1 (its norm multiplies by 1 + w):
the 1 is added (`norm_offset`), in fp32, so the model's norms are plain ones.
GGUF files hold them with the 1 added already (llama.cpp's converter adds
it), and so do qoqserve's own QoQ checkpoints.

Granite's scalar multipliers, folded so that the model is a Llama (and its
QoQ checkpoint a Llama checkpoint):

* `embedding_multiplier` m_e: the embedding table times m_e;
* `residual_multiplier` m_r (each sublayer's output times m_r before the
  residual add): o_proj and down_proj times m_r;
* `attention_multiplier` (the scores' scale in place of 1/sqrt(head_dim)):
  q_proj times it * sqrt(head_dim), since RoPE is linear in q;
* `logits_scaling` s (the logits divided by s): the final norm's weight over
  s, and over m_e too where the LM head is the (scaled) embedding table.

Each factor multiplies the tensor in fp32 (rounded once, to what the model
holds, when it is copied in); a factor of 1 leaves the tensor as read.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import torch


def granite_folds(cfg: dict[str, Any], head_dim: int, tied: bool) -> dict[str, float]:
    """Of an HF config: checkpoint-name suffix -> factor (empty for other architectures)."""
    if "GraniteForCausalLM" not in (cfg.get("architectures") or []):
        return {}
    return folds_of(cfg.get("embedding_multiplier"), cfg.get("residual_multiplier"),
                    cfg.get("attention_multiplier"), cfg.get("logits_scaling"), head_dim, tied)


def folds_of(embedding: float | None, residual: float | None, attention: float | None, logits: float | None,
             head_dim: int, tied: bool) -> dict[str, float]:
    """The four multipliers (None: absent, no change) -> checkpoint-name suffix -> factor."""
    emb, res, logits = float(embedding or 1.0), float(residual or 1.0), float(logits or 1.0)
    q = 1.0 if attention is None else float(attention) * math.sqrt(head_dim)
    folds = {"embed_tokens.weight": emb, "self_attn.o_proj.weight": res, "mlp.down_proj.weight": res,
             "self_attn.q_proj.weight": q, "self_attn.q_proj.bias": q,
             "model.norm.weight": 1.0 / (logits * (emb if tied else 1.0))}
    return {k: v for k, v in folds.items() if v != 1.0}


def factor_of(folds: dict[str, float], name: str) -> float:
    return next((f for suffix, f in folds.items() if name.endswith(suffix)), 1.0)


def folded(t: torch.Tensor, factor: float) -> torch.Tensor:
    return t if factor == 1.0 else t.float() * factor


def is_norm_weight(name: str) -> bool:
    """An RMSNorm's weight: the layers' norms, the q/k norms and the final one."""
    return name.endswith("norm.weight")


def norm_offset(t: torch.Tensor) -> torch.Tensor:
    """A Gemma norm weight as stored (w - 1) -> the plain norm's (w)."""
    return t.float() + 1.0


def transform_of(folds: dict[str, float], name: str, offset_norms: bool):
    """What is applied to tensor `name` as it is read (None: nothing)."""
    if offset_norms and is_norm_weight(name):
        return norm_offset
    factor = factor_of(folds, name)
    return None if factor == 1.0 else functools.partial(folded, factor=factor)
