"""QOQSERVE_CPU_ISA: the one cap on the vector paths every CPU kernel may take,
read here for the Python side and by isa_cap.h for the kernels that read it
themselves. The paths in order; each kernel takes the best one it has at or
below the cap that the CPU runs (probed at run time)."""
from __future__ import annotations

import os

import torch

ENV = "QOQSERVE_CPU_ISA"
# scalar: the portable loops; avx2: AVX2 + FMA, no AVX-512; avx512: F/BW/VL/DQ
# without VNNI or BF16 dot products; avx512-vnni: those, no AMX; amx:
# everything (as unset or "auto")
LEVELS = ("scalar", "avx2", "avx512", "avx512-vnni", "amx")


def requested() -> str | None:
    """The level QOQSERVE_CPU_ISA names, None when unset or "auto"."""
    want = os.environ.get(ENV, "").strip().lower()
    if want in ("", "auto"):
        return None
    if want not in LEVELS:
        raise ValueError(f"{ENV}={want!r}: use auto, " + ", ".join(LEVELS))
    return want


def cap() -> str:
    """The level QOQSERVE_CPU_ISA allows ("amx", everything, when unset)."""
    return requested() or LEVELS[-1]


def allows(level: str) -> bool:
    """Whether the cap lets a kernel take `level`."""
    return LEVELS.index(level) <= LEVELS.index(cap())


def torch_has_avx512_kernels() -> bool:
    """Whether torch's own CPU kernels run their AVX-512 builds here. Below
    them torch's INT8 GEMM is a scalar loop and its bf16 GEMM has no vector
    kernel, so qoq_ref.int8_mm and the bf16 dense linears go around them."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")
