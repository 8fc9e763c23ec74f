"""Writing a QoQ W4A8 checkpoint directory (format: docs/format.md)."""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

import qoqserve
from qoqserve.model_loader.qoq_checkpoint import FORMAT_NAME, FORMAT_VERSION, linear_shapes
from qoqserve.quant import sim
from qoqserve.quant.calibration import CalibrationSet
from qoqserve.quant.pipeline import QuantResult

_HF_ARCH = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2")}


def hf_config(arch) -> dict:
    cls, model_type = _HF_ARCH[arch.architecture]
    return {
        "architectures": [cls], "model_type": model_type, "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size, "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_layers, "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads, "head_dim": arch.head_dim,
        "rms_norm_eps": arch.rms_norm_eps, "rope_theta": arch.rope_theta,
        "rope_scaling": arch.rope_scaling, "max_position_embeddings": arch.max_position_embeddings,
        "tie_word_embeddings": arch.tie_word_embeddings, "attention_bias": arch.attention_bias,
        "bos_token_id": arch.bos_token_id, "eos_token_id": arch.eos_token_ids,
        "torch_dtype": "float16",
    }


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
        json.dump(hf_config(result.model.cfg), f, indent=2)
    quant = {
        "format": FORMAT_NAME, "version": FORMAT_VERSION, "method": "qoq",
        "group_size": cfg.group_size, "w_bits": 4, "a_bits": 8, "kv_bits": cfg.kv_bits,
        "steps": result.steps, "config": cfg.to_dict(),
        "calibration": {"sha256": calib.sha256, "file": os.path.basename(calib.source),
                        "samples": len(calib.samples), "seq_len": len(calib.samples[0])},
        "source_model": source.name, "quantized_by": f"qoqserve {qoqserve.__version__}",
        "seconds": round(result.seconds, 1), "layers": result.layer_info,
    }
    with open(os.path.join(out_dir, "quant_config.json"), "w") as f:
        json.dump(quant, f, indent=2)
    source.tokenizer.save(out_dir)
