"""What the random-weight GGUFs of the llama.cpp comparisons share
(llama_1b_1207/, gemma2_2b_1207/ and gemma3_1b_1207/write_gguf.py): a
Llama-family model laid out as llama.cpp's converter writes it, random F16
weights (normal, std 0.02, drawn in one fixed order), ones for the norms
(llama.cpp's Gemma files hold 1 + w), and a placeholder BPE vocabulary."""
import gguf
import numpy as np


def writer(path: str, arch: str, vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int,
           context: int, eps: float, pre: str = "default", eos: int = 1, bos: int = 2) -> gguf.GGUFWriter:
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(layers)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list([f"<t{i}>" for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_token_merges(["<t0> <t1>"])  # llama.cpp refuses a BPE vocabulary without merges
    w.add_eos_token_id(eos)
    w.add_bos_token_id(bos)
    return w


def write_weights(w: gguf.GGUFWriter, vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int,
                  head_dim: int, norms: tuple[str, ...], head_norms: tuple[str, ...] = ()) -> None:
    """The embeddings (tied: no output matrix), the final norm, and per layer
    the given [hidden] norms, [head_dim] head_norms, q/k/v/o and the gated
    MLP; then the file is written and closed."""
    rng = np.random.default_rng(0)

    def weight(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    w.add_tensor("token_embd.weight", weight(vocab, hidden))
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(layers):
        b = f"blk.{i}."
        for name in norms:
            w.add_tensor(b + name + ".weight", np.ones(hidden, dtype=np.float32))
        for name in head_norms:
            w.add_tensor(b + name + ".weight", np.ones(head_dim, dtype=np.float32))
        w.add_tensor(b + "attn_q.weight", weight(heads * head_dim, hidden))
        w.add_tensor(b + "attn_k.weight", weight(kv_heads * head_dim, hidden))
        w.add_tensor(b + "attn_v.weight", weight(kv_heads * head_dim, hidden))
        w.add_tensor(b + "attn_output.weight", weight(hidden, heads * head_dim))
        w.add_tensor(b + "ffn_gate.weight", weight(inter, hidden))
        w.add_tensor(b + "ffn_up.weight", weight(inter, hidden))
        w.add_tensor(b + "ffn_down.weight", weight(hidden, inter))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
