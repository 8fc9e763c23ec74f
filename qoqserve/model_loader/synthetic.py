"""Synthetic models: real architectures with seeded random weights, for
benchmarks that need no downloaded checkpoint (GPU runs have no network).

    synthetic:llama-3-8b            full-precision weights
    synthetic:llama-3-8b:qoq-g128   a QoQ W4A8 checkpoint (g128, g64 or chn) with KV4
    synthetic:llama-2-7b:qoq-g128-kv8   ... with KV8 pages instead
    synthetic:qwen3-8b:qoq-g128     Qwen3 (per-head q/k norms)

Token ids are generated directly (the tokenizer is a placeholder whose
tokens are "t<id>"), so outputs are meaningless but every kernel runs on the
real shapes with valid value ranges.
"""
from __future__ import annotations

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from qoqserve.errors import ModelLoadError
from qoqserve.layers.quantization import (
    QoQConfig,
    QuantizationConfig,
    UnquantizedConfig,
)
from qoqserve.models.arch import ModelArchConfig, sliding_pattern

from .base import ModelSource
from .schema import expected_tensors
from .tokenizer import Tokenizer

PREFIX = "synthetic:"

# name -> (vocab, hidden, intermediate, layers, heads, kv heads, head_dim, rope theta, tied)
ARCHS = {
    "llama-3-8b": (128256, 4096, 14336, 32, 32, 8, 128, 500000.0, False),
    "llama-3-70b": (128256, 8192, 28672, 80, 64, 8, 128, 500000.0, False),
    "llama-3.2-1b": (128256, 2048, 8192, 16, 32, 8, 64, 500000.0, True),
    "llama-2-7b": (32000, 4096, 11008, 32, 32, 32, 128, 10000.0, False),
    "llama-2-13b": (32000, 5120, 13824, 40, 40, 40, 128, 10000.0, False),
    "mistral-7b": (32000, 4096, 14336, 32, 32, 8, 128, 1000000.0, False),
    "smollm2-135m": (49152, 576, 1536, 30, 9, 3, 64, 100000.0, True),
    "qwen3-8b": (151936, 4096, 12288, 36, 32, 8, 128, 1000000.0, False),
    "tiny": (512, 128, 256, 2, 4, 2, 32, 10000.0, False),
    "tiny-qwen3": (512, 128, 256, 2, 4, 2, 64, 1000000.0, False),
    "tiny-phi3": (512, 128, 256, 2, 4, 2, 32, 10000.0, False),
    "gemma-2-2b": (256000, 2304, 9216, 26, 8, 4, 256, 10000.0, True),
    "tiny-gemma2": (512, 128, 256, 4, 4, 2, 64, 10000.0, True),
    "gemma-3-1b": (262144, 1152, 6912, 26, 4, 1, 256, 1000000.0, True),
    "tiny-gemma3": (512, 128, 256, 6, 4, 2, 64, 1000000.0, True),
}
# the architecture where it is not "llama" (qwen3: per-head q/k norms; phi3:
# q/k/v and gate/up fused in the checkpoint too)
ARCHITECTURE = {"qwen3-8b": "qwen3", "tiny-qwen3": "qwen3", "tiny-phi3": "phi3", "gemma-2-2b": "gemma2",
                "tiny-gemma2": "gemma2", "gemma-3-1b": "gemma3", "tiny-gemma3": "gemma3"}


def _gemma3(window: int, layers: int, hidden: int, head_dim: int) -> dict:
    """What Gemma 3's shapes add: GeGLU, scaled embeddings, five sliding layers to a global one."""
    return dict(mlp_act="gelu_tanh", embed_scale=hidden ** 0.5, attn_scale=head_dim ** -0.5, rope_local_theta=1e4,
                sliding_window=window, sliding_layers=sliding_pattern(layers, 6))


def _gemma2(window: int, layers: int, hidden: int, head_dim: int) -> dict:
    """Gemma 2's: GeGLU, scaled embeddings, every other layer sliding, scores
    and logits soft-capped at 50 and 30."""
    return dict(mlp_act="gelu_tanh", embed_scale=hidden ** 0.5, attn_scale=head_dim ** -0.5, attn_softcap=50.0,
                logit_softcap=30.0, sliding_window=window, sliding_layers=sliding_pattern(layers, 2))


EXTRA = {"gemma-2-2b": _gemma2(4096, 26, 2304, 256), "tiny-gemma2": _gemma2(32, 4, 128, 64),
         "gemma-3-1b": _gemma3(512, 26, 1152, 256), "tiny-gemma3": _gemma3(32, 6, 128, 64)}
FORMATS = ("fp", "qoq-g128", "qoq-g64", "qoq-chn")


def is_synthetic(path: str | None) -> bool:
    return bool(path) and path.startswith(PREFIX)


def synthetic_arch(name: str) -> ModelArchConfig:
    if name not in ARCHS:
        raise ModelLoadError(f"unknown synthetic model {name!r}; choose from {sorted(ARCHS)}")
    vocab, h, inter, layers, heads, kv, hd, theta, tied = ARCHS[name]
    return ModelArchConfig(architecture=ARCHITECTURE.get(name, "llama"), vocab_size=vocab, hidden_size=h,
                           intermediate_size=inter,
                           num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=hd,
                           rope_theta=theta, max_position_embeddings=8192, tie_word_embeddings=tied,
                           bos_token_id=1, eos_token_ids=[2], **EXTRA.get(name, {}))


def _placeholder_tokenizer(vocab: int) -> Tokenizer:
    backend = HFTokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend, bos_token_id=1, eos_token_ids=[2])


def _parse(spec: str) -> tuple[str, str, int]:
    parts = spec[len(PREFIX):].split(":")
    name, fmt = parts[0], (parts[1] if len(parts) > 1 else "fp")
    kv_bits = 4
    if fmt.endswith("-kv8"):
        fmt, kv_bits = fmt[:-4], 8
    if len(parts) > 2 or fmt not in FORMATS:
        raise ModelLoadError(f"{spec!r}: expected synthetic:NAME[:FORMAT] with FORMAT one of "
                             f"{', '.join(FORMATS)} (QoQ formats may end in -kv8)")
    return name, fmt, kv_bits


def _tensors(arch: ModelArchConfig, quant: QuantizationConfig, seed: int):
    """Random tensors for every name of the schema, in the ranges real ones have."""
    g = torch.Generator().manual_seed(seed)
    group = getattr(quant, "group_size", 0)
    for name, spec in expected_tensors(arch, quant).items():
        shape, leaf = spec.shape, name.rsplit(".", 1)[1]
        if leaf == "qweight":
            yield name, torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        elif leaf == "s1":  # |W| ~ 0.02 for INT8 magnitudes ~ 60
            yield name, (torch.rand(shape, generator=g) * 3e-4 + 2e-4).half()
        elif leaf == "s2":
            yield name, torch.randint(1, 9, shape, generator=g, dtype=torch.uint8)  # s2*(u-8) fits INT8
        elif leaf == "zeros":
            fill = torch.full(shape, 8, dtype=torch.uint8) if group else \
                torch.randint(0, 16, shape, generator=g, dtype=torch.uint8)
            yield name, fill
        elif name.endswith("norm.weight"):
            yield name, torch.ones(shape, dtype=torch.float16)
        else:
            yield name, (torch.randn(shape, generator=g) * 0.02).half()


def load_synthetic(spec: str, seed: int = 0) -> ModelSource:
    name, fmt, kv_bits = _parse(spec)
    arch = synthetic_arch(name)
    quant: QuantizationConfig = UnquantizedConfig()
    if fmt != "fp":
        group = {"qoq-g128": 128, "qoq-g64": 64, "qoq-chn": 0}[fmt]
        dims = (arch.hidden_size, arch.intermediate_size, arch.num_heads * arch.head_dim)
        if group and any(d % group for d in dims):
            raise ModelLoadError(f"{spec!r}: input sizes {dims} are not all multiples of group {group}")
        quant = QoQConfig(group, kv_bits)
    return ModelSource(path=spec, name=spec[len(PREFIX):], arch=arch,
                       tokenizer=_placeholder_tokenizer(arch.vocab_size),
                       tensor_iter_factory=lambda: _tensors(arch, quant, seed), quant_config=quant)
