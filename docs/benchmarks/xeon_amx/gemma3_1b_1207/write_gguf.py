"""A Gemma-3-1B-shaped GGUF of random F16 weights (hidden 1152, 26 layers,
4 query / 1 KV heads of 256, MLP 6912, vocabulary 262,144, tied
embeddings, q/k norms, five layers sliding over 512 to every global one,
RoPE base 1e6 global and 1e4 local), laid out as llama.cpp's converter
writes a gemma3, for llama-quantize and llama-bench. Usage: python
write_gguf.py OUT.gguf"""
import sys

import gguf
import numpy as np

V, H, INTER, LAYERS, NH, NKV, D = 262144, 1152, 6912, 26, 4, 1, 256
w = gguf.GGUFWriter(sys.argv[1], "gemma3")
w.add_block_count(LAYERS)
w.add_context_length(32768)
w.add_embedding_length(H)
w.add_feed_forward_length(INTER)
w.add_head_count(NH)
w.add_head_count_kv(NKV)
w.add_key_length(D)
w.add_value_length(D)
w.add_layer_norm_rms_eps(1e-6)
w.add_rope_freq_base(1e6)
w.add_sliding_window(512)
w.add_tokenizer_model("gpt2")
w.add_tokenizer_pre("default")
w.add_token_list([f"<t{i}>" for i in range(V)])
w.add_token_types([1] * V)
w.add_token_merges(["<t0> <t1>"])  # llama.cpp refuses a BPE vocabulary without merges
w.add_eos_token_id(1)
w.add_bos_token_id(2)
rng = np.random.default_rng(0)


def weight(*shape):
    return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)


def norm(n=H):  # llama.cpp's Gemma files hold 1 + w
    return np.ones(n, dtype=np.float32)


w.add_tensor("token_embd.weight", weight(V, H))
w.add_tensor("output_norm.weight", norm())
for i in range(LAYERS):
    b = f"blk.{i}."
    for name in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
        w.add_tensor(b + name + ".weight", norm())
    w.add_tensor(b + "attn_q_norm.weight", norm(D))
    w.add_tensor(b + "attn_k_norm.weight", norm(D))
    w.add_tensor(b + "attn_q.weight", weight(NH * D, H))
    w.add_tensor(b + "attn_k.weight", weight(NKV * D, H))
    w.add_tensor(b + "attn_v.weight", weight(NKV * D, H))
    w.add_tensor(b + "attn_output.weight", weight(H, NH * D))
    w.add_tensor(b + "ffn_gate.weight", weight(INTER, H))
    w.add_tensor(b + "ffn_up.weight", weight(INTER, H))
    w.add_tensor(b + "ffn_down.weight", weight(H, INTER))
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
