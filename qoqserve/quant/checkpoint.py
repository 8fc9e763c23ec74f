"""Writing a QoQ W4A8 checkpoint directory (format: docs/format.md)."""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from qoqserve.layers.quantization import QoQConfig
from qoqserve.model_loader.generation_config import write_generation_config
from qoqserve.model_loader.schema import expected_tensors
from qoqserve.quant.calibration import CalibrationSet
from qoqserve.quant.config import QuantConfig
from qoqserve.quant.pipeline import QUANTIZER_REVISION, QuantResult
from qoqserve.version import __version__


def runtime_config(cfg: QuantConfig, num_layers: int) -> QoQConfig:
    """The runtime scheme a recipe's checkpoint is read with."""
    return QoQConfig(cfg.group_size, cfg.kv_bits, cfg.uses_key_transform, cfg.w8a8_names(num_layers))


def export_tensors(result: QuantResult) -> dict[str, torch.Tensor]:
    """Every tensor the runtime's schema asks for, taken from the quantized
    model by the name load_weights maps it to: the writer cannot write a name
    the loader does not expect, nor leave one out."""
    model = result.model
    qoq = runtime_config(result.config, model.cfg.num_layers)
    params = dict(model.named_parameters(remove_duplicate=False))
    out = {}
    for name, spec in expected_tensors(model.cfg, qoq).items():
        target, _ = model.map_checkpoint_name(name)
        t = params[target].detach()
        t = t.to(spec.dtype or qoq.float_storage_dtype(name))
        if tuple(t.shape) != spec.shape:
            raise ValueError(f"{name}: quantized model holds {tuple(t.shape)}, schema says {spec.shape}")
        out[name] = t.contiguous().cpu()
    return out


def save_checkpoint(result: QuantResult, source, calib: CalibrationSet, out_dir: str) -> None:
    cfg = result.config
    if not cfg.is_qoq_format:
        raise ValueError(f"config {cfg.name!r} is a simulation-only baseline; only W4A8 "
                         "(g64/g128/chn) configs produce a checkpoint")
    os.makedirs(out_dir, exist_ok=True)
    save_file(export_tensors(result), os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(result.model.cfg.to_hf_config("float16"), f, indent=2)
    quant = {
        **runtime_config(cfg, result.model.cfg.num_layers).to_config(),
        "steps": result.steps, "config": cfg.to_dict(),
        "calibration": {"sha256": calib.sha256, "file": os.path.basename(calib.source),
                        "samples": len(calib.samples), "windows": calib.describe()},
        "source_model": source.name, "quantized_by": f"qoqserve {__version__}",
        "quantizer_revision": QUANTIZER_REVISION,
        "seconds": round(result.seconds, 1), "layers": result.layer_info,
    }
    with open(os.path.join(out_dir, "quant_config.json"), "w") as f:
        json.dump(quant, f, indent=2)
    write_generation_config(out_dir, source)
    source.tokenizer.save(out_dir)
