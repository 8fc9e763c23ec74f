"""A Llama-3.2-1B-shaped GGUF of random F16 weights (hidden 2048, 16
layers, 32 query / 8 KV heads of 64, MLP 8192, vocabulary 128,256, tied
embeddings), laid out as llama.cpp's converter writes a llama, for
llama-quantize and llama-bench. Usage: python write_gguf.py OUT.gguf"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from random_gguf import write_weights, writer  # noqa: E402

SHAPE = dict(vocab=128256, hidden=2048, inter=8192, layers=16, heads=32, kv_heads=8)
w = writer(sys.argv[1], "llama", **SHAPE, context=8192, eps=1e-5, pre="llama-bpe", eos=128255, bos=128254)
w.add_rope_freq_base(500000.0)
w.add_rope_dimension_count(64)
write_weights(w, **SHAPE, head_dim=64, norms=("attn_norm", "ffn_norm"))
