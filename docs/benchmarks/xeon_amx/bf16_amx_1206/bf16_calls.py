"""bf16 rows x bf16 weights, one call's time (fastest of 3 x 40 calls,
cycling over 8 weight copies): float_linear's AMX-BF16 tiles (path 4), its
AVX512-BF16 dot products (path 3) and oneDNN (torch F.linear), the embedded
model's shapes. OMP_NUM_THREADS=2 python bf16_calls.py"""
import time

import torch

from qoqserve.kernels.cpu import float_linear

torch.manual_seed(0)
shapes = {"qkv 960x576": (960, 576), "o 576x576": (576, 576), "gate_up 3072x576": (3072, 576),
          "down 576x1536": (576, 1536), "head 49152x576": (49152, 576)}
print("rows: AMX us / dot us / oneDNN us")
for name, (n, k) in shapes.items():
    ws = [torch.randn(n, k).bfloat16() for _ in range(8 if n < 10000 else 2)]
    out = []
    for m in (1, 2, 4, 8, 16, 32, 64, 256):
        x = torch.randn(m, k).bfloat16()

        def t(fn):
            best = 1e9
            for _ in range(3):
                s = time.perf_counter()
                for i in range(40):
                    fn(x, ws[i % len(ws)])
                best = min(best, (time.perf_counter() - s) / 40)
            return best * 1e6
        a = t(lambda x, w: float_linear.float_linear(x, w, None, use_simd=4, out_dtype=torch.bfloat16))
        d = t(lambda x, w: float_linear.float_linear(x, w, None, use_simd=3, out_dtype=torch.bfloat16))
        o = t(lambda x, w: torch.nn.functional.linear(x, w))
        out.append(f"{m}:{a:.0f}/{d:.0f}/{o:.0f}")
    print(name, "->", " ".join(out), flush=True)
