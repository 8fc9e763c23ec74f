"""One layer's KV4 decode attention call at batch 32 x 1,000-token contexts (9
query heads, 3 KV heads, head_dim 64, pages scattered over the pool): warm (the
same pool called again), rotating over 8 pools (8 x 6.9 MB between two visits of
one, as a step walks its layers), and after writing 800 MB (nothing of the pages
left in any cache). Run from the repository root."""
import sys
import time

import torch

sys.path.insert(0, "tests")
from conftest import make_pages  # noqa: E402

from qoqserve.kernels.cpu import paged_decode  # noqa: E402

B, L, H, HKV, D = 32, 1000, 9, 3, 64
POOLS = []
for layer in range(8):
    layout, cache, tables, lens = make_pages(H, HKV, D, [L] * B, bs=16, num_blocks=B * (-(-L // 16)) + 8, seed=layer)
    k, v = layout.page_rows(cache)
    POOLS.append((k, v, tables, lens))
q = torch.randn(B, H, D)
flush = torch.empty(800 << 20, dtype=torch.uint8)


def timed(i: int) -> float:
    k, v, tables, lens = POOLS[i]
    t = time.perf_counter()
    paged_decode.paged_decode_attention(q, k, v, "int4", 16, tables, lens, 0.125)
    return time.perf_counter() - t


for _ in range(3):
    warm = min(timed(0) for _ in range(10))
    rot = sorted(timed(i % 8) for i in range(16))
    cold = []
    for i in range(5):
        flush.fill_(i)
        cold.append(timed(0))
    cold.sort()
    print(f"warm {warm * 1e6:.0f} us | rotating 8 pools {rot[0] * 1e6:.0f}-{rot[8] * 1e6:.0f} us (min-median)"
          f" | after an 800 MB flush {cold[0] * 1e6:.0f}-{cold[2] * 1e6:.0f} us", flush=True)
