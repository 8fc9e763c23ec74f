"""The weight-name schema: which tensors a checkpoint of an architecture and
quantization scheme must hold, under HF names, with shapes and dtypes.

One owner: it is derived from the model itself, built on the meta device with
the scheme's linear method (LlamaForCausalLM.checkpoint_schema), so the names
the loader checks, the names load_weights maps and the tensors the quantizer
writes cannot drift apart.
"""
from __future__ import annotations

import torch

from qoqserve.errors import ModelLoadError
from qoqserve.layers.linear import Linear
from qoqserve.layers.parallel import TensorParallel
from qoqserve.layers.quantization import QuantizationConfig, UnquantizedConfig
from qoqserve.models.arch import ModelArchConfig
from qoqserve.models.llama import LlamaForCausalLM, TensorSpec

ST_DTYPES = {torch.uint8: "U8", torch.int8: "I8", torch.float16: "F16", torch.bfloat16: "BF16",
             torch.float32: "F32"}
FLOAT_ST_DTYPES = {"F64", "F32", "F16", "BF16"}


def meta_model(arch: ModelArchConfig, quant: QuantizationConfig | None = None,
               tp: TensorParallel | None = None) -> LlamaForCausalLM:
    """The model with `quant`'s parameters, on the meta device: shapes, no data
    (tp: rank tp.rank's shard of it)."""
    quant = quant or UnquantizedConfig()
    try:
        with torch.device("meta"):
            return LlamaForCausalLM(arch, None, torch.float16, linear_method=quant.linear_methods(),
                                    max_positions=1, key_transform=quant.key_transform, tp=tp)
    except ValueError as e:  # e.g. a group size that does not divide a linear's input
        raise ModelLoadError(f"{quant.name} checkpoint does not fit this model: {e}") from None


def check_parallel_fit(arch: ModelArchConfig, quant: QuantizationConfig, size: int) -> None:
    """Raise ModelLoadError when tensor parallelism of `size` cannot split this
    model (heads, KV heads, MLP channels, quantization groups); every rank's
    shapes are rank 0's, so one meta build checks them all."""
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    meta_model(arch, quant, TensorParallel(0, size))


def expected_tensors(arch: ModelArchConfig,
                     quant: QuantizationConfig | None = None) -> dict[str, TensorSpec]:
    quant = quant or UnquantizedConfig()
    return meta_model(arch, quant).checkpoint_schema(quant.stores_fused_linears or arch.fused_checkpoint_linears)


def linear_shapes(arch: ModelArchConfig, tp: TensorParallel | None = None) -> dict[str, tuple[int, int]]:
    """Each (fused) linear of the model -> (out_features, in_features) (tp: of
    rank tp.rank's shard)."""
    return {f"model.{name}": (m.out_features, m.in_features)
            for name, m in meta_model(arch, tp=tp).named_modules() if isinstance(m, Linear)}


def check_inventory(arch: ModelArchConfig, quant: QuantizationConfig | None,
                    found: dict[str, tuple[tuple[int, ...], str | None]], where: str) -> None:
    """Fail early (before any weight is read) on missing, extra or misshapen
    tensors. found: name -> (shape, safetensors dtype, or None when the format
    converts on read, as GGUF does).

    Extra tensors are an error rather than ignored: a bias or norm we do not
    know about means a model variant we would silently compute wrong.
    """
    expected = expected_tensors(arch, quant)
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    if missing:
        raise ModelLoadError(f"{where}: missing {len(missing)} tensor(s), e.g. {missing[:3]}")
    if extra:
        kind = f" ({quant.name} checkpoint)" if quant is not None and quant.name != "fp" else ""
        raise ModelLoadError(f"{where}: unexpected tensor(s) {extra[:3]} for this "
                             f"{arch.architecture} configuration{kind}")
    for name, spec in expected.items():
        shape, dtype = found[name]
        if tuple(shape) != spec.shape:
            raise ModelLoadError(f"{where}: tensor {name} has shape {list(shape)}, "
                                 f"expected {list(spec.shape)} from the model config")
        if dtype is None:
            continue
        want = ST_DTYPES[spec.dtype] if spec.dtype is not None else None
        if (want is None and dtype not in FLOAT_ST_DTYPES) or (want is not None and dtype != want):
            raise ModelLoadError(f"{where}: tensor {name} has dtype {dtype}, "
                                 f"expected {want or 'a float type'}")
