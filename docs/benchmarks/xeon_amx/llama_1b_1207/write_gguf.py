"""A Llama-3.2-1B-shaped GGUF of random F16 weights (hidden 2048, 16
layers, 32 query / 8 KV heads of 64, MLP 8192, vocabulary 128,256, tied
embeddings), laid out as llama.cpp's converter writes a llama, for
llama-quantize and llama-bench. Usage: python write_gguf.py OUT.gguf"""
import sys

import gguf
import numpy as np

V, H, INTER, LAYERS, NH, NKV, D = 128256, 2048, 8192, 16, 32, 8, 64
w = gguf.GGUFWriter(sys.argv[1], "llama")
w.add_block_count(LAYERS)
w.add_context_length(8192)
w.add_embedding_length(H)
w.add_feed_forward_length(INTER)
w.add_head_count(NH)
w.add_head_count_kv(NKV)
w.add_rope_freq_base(500000.0)
w.add_layer_norm_rms_eps(1e-5)
w.add_rope_dimension_count(D)
w.add_tokenizer_model("gpt2")
w.add_tokenizer_pre("llama-bpe")
w.add_token_list([f"<t{i}>" for i in range(V)])
w.add_token_types([1] * V)
w.add_token_merges(["<t0> <t1>"])  # llama.cpp refuses a BPE vocabulary without merges
w.add_eos_token_id(V - 1)
w.add_bos_token_id(V - 2)
rng = np.random.default_rng(0)


def weight(*shape):
    return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)


w.add_tensor("token_embd.weight", weight(V, H))
w.add_tensor("output_norm.weight", np.ones(H, dtype=np.float32))
for i in range(LAYERS):
    b = f"blk.{i}."
    w.add_tensor(b + "attn_norm.weight", np.ones(H, dtype=np.float32))
    w.add_tensor(b + "ffn_norm.weight", np.ones(H, dtype=np.float32))
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
