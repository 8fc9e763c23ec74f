"""Expand-at-load vs expand-per-call W4A8 on CPU: time of all 120 linears of the
embedded QoQ g64 checkpoint at M = 1, 32, 256 rows, and resident linear bytes.

    python scripts/bench_w4a8_expansion.py   (output: docs/benchmarks/w4a8_expansion_cpu.txt)
"""
import time

import torch

from qoqserve.config import CacheConfig, EngineConfig
from qoqserve.engine.model_runner import ModelRunner
from qoqserve.layers.linear import Linear
from qoqserve.model_loader import load_model_source

# the embedded model's QoQ g64 checkpoint (quantized on first use)
from qoqserve.quant.default_checkpoint import default_qoq_checkpoint

path = default_qoq_checkpoint("g64")
res = {}
for backend in ("torch-int8", "torch-int8-percall"):
    src = load_model_source(path)
    r = ModelRunner(EngineConfig(model=path, dtype="float32", w4a8_backend=backend,
                                 cache=CacheConfig(num_blocks=4)), src.arch, src.iter_tensors(), 512,
                    src.quant_config)
    lins = [m for m in r.model.modules() if isinstance(m, Linear)]
    s = r.stats()
    for m_rows in (1, 32, 256):
        xs = [torch.randn(m_rows, lin.in_features) for lin in lins]
        with torch.inference_mode():
            for lin, x in zip(lins, xs):
                lin(x)
            t = time.perf_counter()
            for _ in range(3):
                for lin, x in zip(lins, xs):
                    lin(x)
            dt = (time.perf_counter() - t) / 3
        print(f"{backend:<20} M={m_rows:<4} all 120 linears: {dt*1e3:7.1f} ms   linear weights "
              f"resident {s['linear_weight_bytes']/2**20:.1f} MiB", flush=True)
