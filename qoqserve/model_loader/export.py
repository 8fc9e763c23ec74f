"""Write any loadable model (GGUF, synthetic, HF) as a plain HF safetensors
directory: GGUF weights dequantized, q/k in HF order, our tokenizer. Other
engines (vLLM, transformers) then serve exactly the weights we serve."""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from .generation_config import write_generation_config
from .scalar_folds import is_norm_weight
from .source import load_model_source

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def export_hf_dir(model: str | None, out_dir: str, dtype: str = "bfloat16") -> str:
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}")
    source = load_model_source(model)
    if source.quant_config.name != "fp":
        raise ValueError(f"{source.path}: a QoQ checkpoint holds integer codes; export its source model")
    os.makedirs(out_dir, exist_ok=True)
    # the norms as Gemma's checkpoints store them (w - 1), the loaders having added the 1
    unfold = source.arch.norm_offset
    tensors = {name: (t.float() - 1.0 if unfold and is_norm_weight(name) else t).to(_DTYPES[dtype]).contiguous()
               for name, t in source.iter_tensors()}
    if source.arch.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(source.arch.to_hf_config(dtype), f, indent=2)
    write_generation_config(out_dir, source)
    source.tokenizer.save(out_dir)
    return out_dir
