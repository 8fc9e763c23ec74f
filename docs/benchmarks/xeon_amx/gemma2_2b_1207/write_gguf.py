"""A Gemma-2-2B-shaped GGUF of random F16 weights (hidden 2304, 26 layers,
8 query / 4 KV heads of 256, MLP 9216, vocabulary 256,000, tied embeddings,
every other layer sliding over 4,096, scores and logits soft-capped at 50
and 30), laid out as llama.cpp's converter writes a gemma2, for
llama-quantize and llama-bench. Usage: python write_gguf.py OUT.gguf"""
import sys

import gguf
import numpy as np

V, H, INTER, LAYERS, NH, NKV, D = 256000, 2304, 9216, 26, 8, 4, 256
w = gguf.GGUFWriter(sys.argv[1], "gemma2")
w.add_block_count(LAYERS)
w.add_context_length(8192)
w.add_embedding_length(H)
w.add_feed_forward_length(INTER)
w.add_head_count(NH)
w.add_head_count_kv(NKV)
w.add_key_length(D)
w.add_value_length(D)
w.add_layer_norm_rms_eps(1e-6)
w.add_sliding_window(4096)
w.add_float32("gemma2.attn_logit_softcapping", 50.0)
w.add_float32("gemma2.final_logit_softcapping", 30.0)
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


def norm():  # llama.cpp's Gemma files hold 1 + w
    return np.ones(H, dtype=np.float32)


w.add_tensor("token_embd.weight", weight(V, H))
w.add_tensor("output_norm.weight", norm())
for i in range(LAYERS):
    b = f"blk.{i}."
    for name in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
        w.add_tensor(b + name + ".weight", norm())
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
