"""Hugging Face model directories: config.json + (sharded) safetensors."""
from __future__ import annotations

import functools
import json
import math
import os
import struct
from typing import Any

from safetensors import safe_open

from qoqserve.errors import ModelLoadError
from qoqserve.layers.quantization import config_from_file
from qoqserve.models.arch import ModelArchConfig, is_multimodal

from .base import ModelSource, TensorIter, read_json_object
from .generation_config import sampling_keys
from .lazy import LazyTensor
from .scalar_folds import granite_folds, transform_of
from .schema import check_inventory
from .tokenizer import tokenizer_from_hf_dir
from .tokenizer_source import load_tokenizer

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
                "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                "U16": 2, "U32": 4, "U64": 8}
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
# buffers some exporters save that are recomputed at runtime
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# a multimodal checkpoint's text model (models/arch.MULTIMODAL_ARCHITECTURES), as
# transformers 4.5x and 5 save it: its prefix -> ours; the vision parts are not read
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def _text_model_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor name as the text model's (None: a vision part)."""
    if name.startswith(_VISION_PREFIXES):
        return None
    for prefix, ours in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return ours + name[len(prefix):]
    return name
_MAX_HEADER = 100 << 20


def read_safetensors_header(path: str) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """name -> (dtype, shape, data start) after checking the file holds every byte
    the header promises. safe_open itself only notices truncation when a tensor
    is read, which is too late to give a useful error."""
    size = os.path.getsize(path)
    if size < 8:
        raise ModelLoadError(f"{path}: {size} bytes, too short to be a safetensors file")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > min(size - 8, _MAX_HEADER):
            raise ModelLoadError(f"{path}: header length field says {n} bytes (file is {size} "
                                 "bytes): truncated, corrupt, or not a safetensors file")
        raw = f.read(n)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:  # UnicodeDecodeError is a ValueError too
        raise ModelLoadError(f"{path}: corrupt safetensors header ({e})") from e
    data_len = size - 8 - n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            itemsize = _DTYPE_BYTES[dtype]
            ok = 0 <= begin <= end and end - begin == math.prod(shape) * itemsize
        except (KeyError, TypeError, ValueError):
            raise ModelLoadError(f"{path}: corrupt header entry for tensor {name!r}: {info!r}")
        if not ok:
            raise ModelLoadError(f"{path}: tensor {name!r} offsets {begin}..{end} do not match "
                                 f"its shape {list(shape)} and dtype {dtype}")
        if end > data_len:
            raise ModelLoadError(
                f"{path}: truncated: tensor {name!r} needs data bytes {begin}..{end} but the file "
                f"only has {data_len} data bytes ({size} bytes total)")
        out[name] = (dtype, shape, begin)
    return out


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: no weight_map")
        files = list(dict.fromkeys(weight_map.values()))
        for f in files:
            if not os.path.isfile(os.path.join(path, f)):
                raise ModelLoadError(f"{os.path.join(path, f)}: shard listed in {index} is missing")
        return [os.path.join(path, f) for f in files]
    if os.path.isfile(single):
        return [single]
    others = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if others:
        return [os.path.join(path, f) for f in others]
    hint = " (PyTorch .bin checkpoints are not supported; convert to safetensors)" \
        if any(f.endswith(".bin") for f in os.listdir(path)) else ""
    raise ModelLoadError(f"{single}: missing; no safetensors weights in {path}{hint}")


def _display_name(path: str) -> str:
    # HF cache layout: .../models--org--name/snapshots/<commit>
    parent = os.path.dirname(path)
    if os.path.basename(parent) == "snapshots":
        repo_dir = os.path.basename(os.path.dirname(parent))
        if repo_dir.startswith("models--"):
            return repo_dir.split("--")[-1]
    return os.path.basename(path.rstrip(os.sep))


def _token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else [v for v in value if isinstance(v, int)]


def load_hf_dir(path: str, tok_spec: str | None = None) -> ModelSource:
    """tok_spec: where to take the tokenizer from instead of this directory
    (tokenizer_source.load_tokenizer)."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelLoadError(f"{cfg_path}: missing; not a Hugging Face model directory")
    cfg = read_json_object(cfg_path)
    try:
        arch = ModelArchConfig.from_hf_config(cfg)
    except (KeyError, TypeError) as e:
        raise ModelLoadError(f"{cfg_path}: missing or invalid field {e}") from e

    gen_path, gen = os.path.join(path, "generation_config.json"), {}
    if os.path.isfile(gen_path):
        gen = read_json_object(gen_path)
        arch.eos_token_ids = list(dict.fromkeys(arch.eos_token_ids
                                                + _token_ids(gen.get("eos_token_id"))))
        if arch.bos_token_id is None and isinstance(gen.get("bos_token_id"), int):
            arch.bos_token_id = gen["bos_token_id"]

    quant_path = os.path.join(path, "quant_config.json")
    quant_file = read_json_object(quant_path) if os.path.isfile(quant_path) else None
    quant = config_from_file(quant_file, quant_path)

    files = _weight_files(path)
    multimodal = is_multimodal(cfg)
    located: dict[str, tuple[str, int]] = {}  # name -> (file, data offset)
    stored: dict[str, str] = {}  # name -> its name in the file, where the two differ (a multimodal text model)
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    for file in files:
        for name, (dtype, shape, begin) in read_safetensors_header(file).items():
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if multimodal:
                file_name, name = name, _text_model_name(name)
                if name is None:
                    continue
                if name != file_name:
                    stored[name] = file_name
            if name == "lm_head.weight" and arch.tie_word_embeddings:
                continue  # some exporters store the tied copy anyway
            if dtype not in _FLOAT_DTYPES and quant_file is None:
                raise ModelLoadError(f"{file}: tensor {name!r} has non-float dtype {dtype} "
                                     "(only QoQ checkpoints with quant_config.json hold integers)")
            if name in located:
                raise ModelLoadError(f"{file}: tensor {name!r} also present in {located[name][0]}")
            located[name], shapes[name], dtypes[name] = (file, begin), shape, dtype
    where = files[0] if len(files) == 1 else os.path.join(path, "model.safetensors.index.json")
    check_inventory(arch, quant, {n: (shapes[n], dtypes[n]) for n in shapes}, where)

    tokenizer = (tokenizer_from_hf_dir(path, arch.eos_token_ids, arch.bos_token_id) if tok_spec is None
                 else load_tokenizer(tok_spec, arch.eos_token_ids, arch.bos_token_id))
    # one eos list for everyone: stop on any id the config or the tokenizer names
    arch.eos_token_ids = tokenizer.eos_token_ids = list(
        dict.fromkeys(arch.eos_token_ids + tokenizer.eos_token_ids))
    if arch.bos_token_id is None:
        arch.bos_token_id = tokenizer.bos_token_id

    folds = granite_folds(cfg, arch.head_dim, arch.tie_word_embeddings)
    offset_norms = arch.norm_offset and quant_file is None  # a QoQ checkpoint holds them added (scalar_folds.py)

    def iter_tensors(lazy: bool = False) -> TensorIter:
        """lazy: LazyTensors, read when (and where) the loader materializes them;
        each stays readable until the next one is yielded."""
        for file in files:
            # data-offset order keeps reads sequential on disk
            names = sorted((n for n, (f, _) in located.items() if f == file),
                           key=lambda n: located[n][1])
            with safe_open(file, framework="pt") as handle:
                for name in names:
                    transform = transform_of(folds, name, offset_norms)
                    if lazy:
                        yield name, LazyTensor(handle.get_slice(stored.get(name, name)), shapes[name],
                                               functools.partial(quant.check_tensor, name, where=file),
                                               transform=transform)
                        continue
                    tensor = handle.get_tensor(stored.get(name, name))
                    quant.check_tensor(name, tensor, file)
                    yield name, tensor if transform is None else transform(tensor)

    return ModelSource(path=path, name=_display_name(path), arch=arch, tokenizer=tokenizer,
                       tensor_iter_factory=iter_tensors, quant_config=quant,
                       lazy_iter_factory=functools.partial(iter_tensors, lazy=True),
                       generation_config=sampling_keys(gen))
