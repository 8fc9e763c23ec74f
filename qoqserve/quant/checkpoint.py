"""Writing a QoQ W4A8 checkpoint directory (format: docs/format.md)."""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from qoqserve.model_loader.qoq_checkpoint import (
    FORMAT_NAME,
    FORMAT_VERSION,
    linear_shapes,
)
from qoqserve.quant import sim
from qoqserve.quant.calibration import CalibrationSet
from qoqserve.quant.pipeline import QuantResult
from qoqserve.version import __version__


def export_tensors(result: QuantResult) -> dict[str, torch.Tensor]:
    model = result.model
    out = {"model.embed_tokens.weight": model.embed_tokens.detach().half(),
           "model.norm.weight": model.norm.weight.detach().half()}
    if not model.cfg.tie_word_embeddings:
        out["lm_head.weight"] = model.lm_head.detach().half()
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = layer.input_layernorm.weight.detach().half()
        out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight.detach().half()
        kt = layer.self_attn.key_transform
        if kt is not None:  # rotation in fp32: fp16 would break its orthogonality
            out[p + "self_attn.key_transform.shift"] = kt.shift.detach().half()
            out[p + "self_attn.key_transform.rotation"] = kt.rotation.detach().float()
    for name in linear_shapes(model.cfg):
        linear = model.get_submodule(name.removeprefix("model."))
        for pname, t in sim.qoq_tensors(linear).items():
            out[f"{name}.{pname}"] = t.half() if pname == "bias" else t
    return {k: v.contiguous().cpu() for k, v in out.items()}


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
        "format": FORMAT_NAME, "version": FORMAT_VERSION, "method": "qoq",
        "group_size": cfg.group_size, "w_bits": 4, "a_bits": 8, "kv_bits": cfg.kv_bits,
        "key_transform": cfg.uses_key_transform,
        "steps": result.steps, "config": cfg.to_dict(),
        "calibration": {"sha256": calib.sha256, "file": os.path.basename(calib.source),
                        "samples": len(calib.samples), "seq_len": len(calib.samples[0])},
        "source_model": source.name, "quantized_by": f"qoqserve {__version__}",
        "seconds": round(result.seconds, 1), "layers": result.layer_info,
    }
    with open(os.path.join(out_dir, "quant_config.json"), "w") as f:
        json.dump(quant, f, indent=2)
    source.tokenizer.save(out_dir)
