"""The header of a GGUF file (llama.cpp's format, version 2 and 3): its
metadata as Python values and its tensors as views of a read-only memory map.

gguf's GGUFReader builds a numpy view per metadata element, seconds for a
tokenizer's vocabulary; here arrays of numbers are one numpy read and
strings one Python slice each.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from qoqserve.errors import ModelLoadError

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# value type -> (struct format, numpy dtype) of the fixed-size scalars
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True, eq=False)  # eq would compare the arrays
class GGUFTensor:
    """One tensor: `dims` in GGUF order (fastest-varying first), `shape`
    row-major (the reverse); `data` is elements for F32/F16 and the raw bytes
    of each row ([..., bytes per row], uint8) for every other type."""
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    dims: tuple[int, ...]
    data_offset: int
    n_bytes: int
    data: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.dims))


_U64 = struct.Struct("<Q")
_FIRST_READ = 8 << 20  # header bytes read at first; a longer header is read again, 4x as much


class _NeedMore(Exception):
    """The header runs past the bytes read so far (but not past the file)."""


class _Cursor:
    """Reads the header from bytes: the file's first len(buf) of file_size."""

    def __init__(self, buf: bytes, path: str, file_size: int):
        self.buf, self.pos, self.path, self.file_size = buf, 0, path, file_size

    def _truncated(self, need: int) -> Exception:
        if len(self.buf) < self.file_size:
            return _NeedMore()
        return ModelLoadError(f"{self.path}: truncated: the header needs bytes up to {need} "
                              f"but the file has {self.file_size}")

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            raise self._truncated(self.pos + n)
        self.pos += n
        return self.buf[self.pos - n:self.pos]

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def strings(self, n: int) -> list[str]:
        # a vocabulary is ~100k of them: one unpack and one slice each, bounds checked once
        buf, pos, out = self.buf, self.pos, []
        try:
            for _ in range(n):
                (size,) = _U64.unpack_from(buf, pos)
                out.append(buf[pos + 8:pos + 8 + size].decode("utf-8"))
                pos += 8 + size
        except struct.error:
            raise self._truncated(pos + 8) from None
        except UnicodeDecodeError:
            raise ModelLoadError(f"{self.path}: the metadata string at byte {pos} is not UTF-8") from None
        if pos > len(buf):
            raise self._truncated(pos)
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.strings(1)[0]
        if vtype == _ARRAY:
            etype, n = self.scalar("<I"), self.scalar("<Q")
            if etype == _STRING:
                return self.strings(n)
            if etype in _SCALARS:
                dtype = np.dtype(_SCALARS[etype][1]).newbyteorder("<")
                return np.frombuffer(self.take(n * dtype.itemsize), dtype=dtype).tolist()
            return [self.value(etype) for _ in range(n)]
        if vtype not in _SCALARS:
            raise ModelLoadError(f"{self.path}: unknown metadata value type {vtype} at byte {self.pos}")
        return self.scalar(_SCALARS[vtype][0])


def _parse_header(cur: _Cursor) -> tuple[dict[str, Any], list[tuple], int]:
    """(metadata, (name, dims, type, offset) per tensor, where the header ends)."""
    if cur.take(4) != _MAGIC:
        raise ModelLoadError(f"{cur.path}: not a GGUF file (no GGUF magic)")
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ModelLoadError(f"{cur.path}: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    # each tensor's entry takes at least 32 bytes, each metadata entry 13
    if 32 * n_tensors + 13 * n_kv > cur.file_size:
        raise ModelLoadError(f"{cur.path}: corrupt header: it counts {n_tensors} tensors and {n_kv} "
                             f"metadata entries, more than {cur.file_size} bytes can hold")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.strings(1)[0]
        meta[key] = cur.value(cur.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.strings(1)[0]
        dims = tuple(cur.scalar("<Q") for _ in range(cur.scalar("<I")))
        infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
    return meta, infos, cur.pos


def read_gguf_header(path: str) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """(metadata, tensors) of the GGUF file at path; ModelLoadError naming the
    file for anything that is not a whole, well-formed GGUF."""
    # lazy: only GGUF files need the gguf package (its type table)
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        # a plain ndarray view: slices of a np.memmap each run a Python __array_finalize__
        mm = np.asarray(np.memmap(path, dtype=np.uint8, mode="r"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot map the file ({e})") from e
    head = _FIRST_READ
    while True:
        try:
            meta, infos, end = _parse_header(_Cursor(mm[:head].tobytes(), path, len(mm)))
            break
        except _NeedMore:
            head *= 4
    alignment = int(meta.get("general.alignment", _DEFAULT_ALIGNMENT))
    start = -(-end // alignment) * alignment
    tensors = []
    for name, dims, type_id, offset in infos:
        try:
            ttype = GGMLQuantizationType(type_id)
        except ValueError:
            raise ModelLoadError(f"{path}: tensor {name} has unknown type {type_id}") from None
        block, type_size = GGML_QUANT_SIZES[ttype]
        rows = tuple(reversed(dims))
        if not dims or dims[0] % block:
            raise ModelLoadError(f"{path}: tensor {name}: dims {dims} are not rows of whole {ttype.name} blocks")
        n_bytes = int(np.prod(dims, dtype=np.int64)) * type_size // block
        begin = start + offset
        if begin + n_bytes > len(mm):
            raise ModelLoadError(f"{path}: truncated: tensor {name} needs bytes up to "
                                 f"{begin + n_bytes} but the file has {len(mm)}")
        raw = mm[begin:begin + n_bytes]
        if ttype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            data = raw.view(np.float32 if ttype == GGMLQuantizationType.F32 else np.float16).reshape(rows)
        else:
            data = raw.reshape(*rows[:-1], dims[0] * type_size // block)
        tensors.append(GGUFTensor(name, ttype, dims, begin, n_bytes, data))
    return meta, tensors
