"""A Gemma-3-1B-shaped GGUF of random F16 weights (hidden 1152, 26 layers,
4 query / 1 KV heads of 256, MLP 6912, vocabulary 262,144, tied
embeddings, q/k norms, five layers sliding over 512 to every global one,
RoPE base 1e6 global and llama.cpp's 1e4 local), laid out as llama.cpp's
converter writes a gemma3, for llama-quantize and llama-bench. Usage:
python write_gguf.py OUT.gguf"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from random_gguf import write_weights, writer  # noqa: E402

SHAPE = dict(vocab=262144, hidden=1152, inter=6912, layers=26, heads=4, kv_heads=1)
w = writer(sys.argv[1], "gemma3", **SHAPE, context=32768, eps=1e-6)
w.add_key_length(256)
w.add_value_length(256)
w.add_rope_freq_base(1e6)
w.add_sliding_window(512)
write_weights(w, **SHAPE, head_dim=256, norms=("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"),
              head_norms=("attn_q_norm", "attn_k_norm"))
