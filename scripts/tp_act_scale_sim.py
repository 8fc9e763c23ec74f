"""The per-token activation scale of a row-parallel input, local slice vs
whole row, simulated in one process (docs/parallel.md): QoQ's fake-quant
reference (`--w4a8-backend sim`) with o_proj's and down_proj's inputs
quantized per rank slice (N slices, each its own per-token scale) or whole,
perplexity of a text over the KV4 pages either way.

    python scripts/tp_act_scale_sim.py [--model qoq] [--tp 3] [FILE]
"""
from __future__ import annotations

import argparse


def main() -> None:
    from qoqserve.eval.perplexity import perplexity, read_texts
    from qoqserve.kernels import qoq_ref
    from qoqserve.layers.quantization import qoq_methods
    from qoqserve.llm import LLM
    from qoqserve.quant.default_checkpoint import resolve_model

    p = argparse.ArgumentParser()
    p.add_argument("file", nargs="?", default="/usr/share/common-licenses/Apache-2.0")
    p.add_argument("--model", default="qoq")
    p.add_argument("--tp", type=int, default=3)
    p.add_argument("--window", type=int, default=512)
    args = p.parse_args()
    llm = LLM(resolve_model(args.model), dtype="float32", w4a8_backend="sim", kv_cache_gb=0.05,
              quantized_prefill=True, enforce_eager=True)
    row_parallel = {id(layer.self_attn.o_proj) for layer in llm.engine.runner.model.layers} | \
                   {id(layer.mlp.down_proj) for layer in llm.engine.runner.model.layers}
    whole = qoq_methods.QoQSimMethod.apply

    def sliced(self, layer, x):
        if id(layer) not in row_parallel or not self.group_size:
            return whole(self, layer, x)
        k = x.shape[-1] // args.tp
        y = sum(qoq_ref.w4a8_group_linear_sim(x[..., r * k:(r + 1) * k], layer.w_expanded[:, r * k:(r + 1) * k],
                                              layer.s1) for r in range(args.tp))
        return y.to(x.dtype)

    ids = llm.tokenizer.encode(read_texts([args.file]))
    for name, fn in (("whole row (= 1 rank)", whole), (f"local slice ({args.tp} ranks)", sliced)):
        qoq_methods.QoQSimMethod.apply = fn
        res = perplexity(llm.engine.prompt_logprobs, ids, args.window, args.window, progress=False)
        print(f"{name}: perplexity {res.ppl:.4f} over {res.num_tokens} tokens", flush=True)
    qoq_methods.QoQSimMethod.apply = whole


if __name__ == "__main__":
    main()
