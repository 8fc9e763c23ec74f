"""What every checkpoint reader hands the engine: a `ModelSource`, i.e.
architecture + tokenizer + lazily streamed tensors under HF Llama names."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from qoqserve.models.arch import ModelArchConfig

from .errors import ModelLoadError
from .tokenizer import Tokenizer

TensorIter = Iterator[tuple[str, torch.Tensor]]


@dataclass
class ModelSource:
    path: str  # resolved path (dir or .gguf file)
    name: str  # short model name for display/API
    arch: ModelArchConfig
    tokenizer: Tokenizer
    # Opens the checkpoint afresh on each call so tensors stream one at a time
    tensor_iter_factory: Callable[[], TensorIter] = field(repr=False, compare=False,
                                                          default=lambda: iter(()))
    # quant_config.json of a QoQ checkpoint (docs/format.md); None = full precision
    quant_config: dict | None = None

    def iter_tensors(self) -> TensorIter:
        """Yield (HF name, tensor) pairs, one tensor materialized at a time."""
        return self.tensor_iter_factory()


def expected_tensor_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `arch` must provide, under HF names."""
    h, inter = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (arch.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
        if arch.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
    return shapes


def check_tensor_inventory(arch: ModelArchConfig, found: dict[str, tuple[int, ...]],
                           where: str) -> None:
    """Fail early (before any weight is read) on missing, extra or misshapen tensors.

    Extra tensors are an error rather than ignored: a bias or norm we do not
    know about means a model variant we would silently compute wrong.
    """
    expected = expected_tensor_shapes(arch)
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    if missing:
        raise ModelLoadError(f"{where}: missing {len(missing)} tensor(s), e.g. {missing[:3]}")
    if extra:
        raise ModelLoadError(f"{where}: unexpected tensor(s) {extra[:3]} for this "
                             f"{arch.architecture} configuration")
    for name, shape in expected.items():
        if tuple(found[name]) != shape:
            raise ModelLoadError(f"{where}: tensor {name} has shape {tuple(found[name])}, "
                                 f"expected {shape} from the model config")
