"""Registers, spills and shared memory of the Triton kernels as the GPU driver
reports them after real launches (scripts/gpu_kernel_meta.py): the
representative variant set of qoqserve.kernels.triton.variants, launched on
zero-filled tensors (compilation depends on shapes, strides and dtypes, not
values; zero block tables and lengths keep every access in bounds)."""
from __future__ import annotations

import torch


def materialize(args: tuple, device) -> tuple:
    """CPU placeholder tensors -> zero tensors on device with the same shape,
    strides and offset into a same-sized base, so views keep their layout."""
    bases: dict[int, torch.Tensor] = {}
    out = []
    for a in args:
        if not isinstance(a, torch.Tensor):
            out.append(a)
            continue
        base = a._base if a._base is not None else a
        key = id(base)
        if key not in bases:
            bases[key] = torch.zeros(base.shape, dtype=base.dtype, device=device)
        out.append(bases[key].as_strided(a.shape, a.stride(), a.storage_offset()))
    return tuple(out)


def meta_rows(kernels: dict) -> list[dict]:
    """name -> JITFunction: one row per compiled variant in its launch cache."""
    rows = []
    for name, fn in kernels.items():
        for caches in getattr(fn, "device_caches", {}).values():
            for compiled in caches[0].values():
                init = getattr(compiled, "_init_handles", None)
                if init:
                    init()
                md = compiled.metadata
                consts = getattr(getattr(compiled, "src", None), "constants", {}) or {}
                names = getattr(fn, "arg_names", [])
                constexprs = {names[k[0]] if k and k[0] < len(names) else str(k): str(v)
                              for k, v in consts.items()}
                rows.append(dict(kernel=name, n_regs=compiled.n_regs, n_spills=compiled.n_spills,
                                 shared=int(md.shared), num_warps=md.num_warps, num_stages=md.num_stages,
                                 constexprs=constexprs))
    return rows


def launched_kernels(modules) -> dict:
    return {n: v for mod in modules for n, v in vars(mod).items()
            if n.endswith("_kernel") and hasattr(v, "device_caches")}


def collect(device: str = "cuda") -> list[dict]:
    # lazy: Triton (imports triton, present only with it)
    from qoqserve.kernels.triton import (
        act_quant,
        kv4_attention,
        paged_decode,
        w4a8_gemm,
    )
    from qoqserve.kernels.triton.variants import engine_launches

    errors = []
    for launch in engine_launches(quick=True):
        try:
            launch.fn[launch.grid](*materialize(launch.args, device), **launch.kwargs)
        except Exception as e:  # reported as a row; the other variants still count
            errors.append(dict(kernel=launch.fn.__name__, label=launch.label,
                               error=f"{type(e).__name__}: {e}".splitlines()[0][:300]))
    torch.cuda.synchronize()
    return meta_rows(launched_kernels((act_quant, w4a8_gemm, paged_decode, kv4_attention))) + errors
