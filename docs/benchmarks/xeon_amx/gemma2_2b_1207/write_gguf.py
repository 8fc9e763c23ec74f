"""A Gemma-2-2B-shaped GGUF of random F16 weights (hidden 2304, 26 layers,
8 query / 4 KV heads of 256, MLP 9216, vocabulary 256,000, tied embeddings,
every other layer sliding over 4,096, scores and logits soft-capped at 50
and 30), laid out as llama.cpp's converter writes a gemma2, for
llama-quantize and llama-bench. Usage: python write_gguf.py OUT.gguf"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from random_gguf import write_weights, writer  # noqa: E402

SHAPE = dict(vocab=256000, hidden=2304, inter=9216, layers=26, heads=8, kv_heads=4)
w = writer(sys.argv[1], "gemma2", **SHAPE, context=8192, eps=1e-6)
w.add_key_length(256)
w.add_value_length(256)
w.add_sliding_window(4096)
w.add_float32("gemma2.attn_logit_softcapping", 50.0)
w.add_float32("gemma2.final_logit_softcapping", 30.0)
write_weights(w, **SHAPE, head_dim=256, norms=("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"))
