import time

import torch

from qoqserve.kernels.cpu import float_linear

torch.manual_seed(0)
shapes = {"qkv 960x576": (960, 576), "gate_up 3072x576": (3072, 576), "down 576x1536": (576, 1536)}
for name, (n, k) in shapes.items():
    ws = [torch.randn(n, k).bfloat16() for _ in range(8)]
    out = []
    for m in (1, 2, 3, 4, 6, 8, 12, 16, 32, 64):
        x = torch.randn(m, k).bfloat16()

        def t(fn):
            best = 1e9
            for r in range(3):
                s = time.perf_counter()
                for i in range(40):
                    fn(x, ws[i % 8])
                best = min(best, (time.perf_counter() - s) / 40)
            return best * 1e6

        c = t(lambda x, w: float_linear.float_linear(x, w, None, out_dtype=torch.bfloat16))
        o = t(lambda x, w: torch.nn.functional.linear(x, w))
        out.append(f"{m}:{c:.0f}/{o:.0f}")
    print(name, "rows: C us / oneDNN us ->", " ".join(out), flush=True)
