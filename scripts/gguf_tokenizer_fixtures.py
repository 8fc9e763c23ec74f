"""Regenerate tests/data/*_llamacpp_tokens.json: what llama.cpp's own server
answers for texts over GGUF tokenizers (tests/test_gguf_tokenizers.py), and
compare this repo's tokenizers with it over many random texts.

    python scripts/gguf_tokenizer_fixtures.py --llama-server /path/to/llama-server [--compare 2000]

For each vocabulary it writes a tiny one-layer Llama GGUF (random weights: the
server needs a model to start), starts llama-server on it, asks /tokenize and
/detokenize, and stops it. SentencePiece: the vocabulary test_gguf_tokenizers
builds (seed 0), with and without the space prefix. Byte-level BPE: the
embedded SmolLM2 vocabulary and merges under another tokenizer.ggml.pre.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import gguf  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from test_gguf_tokenizers import spm_metadata, with_probe_tokens  # noqa: E402
from test_model_loader import _GGUF_NAMES, _llama_cpp_permute  # noqa: E402

from qoqserve.model_loader import default_gguf_path  # noqa: E402
from qoqserve.model_loader.gguf_header import read_gguf_header  # noqa: E402
from qoqserve.model_loader.gguf_tokenizer import tokenizer_from_gguf_metadata  # noqa: E402

DATA = ROOT / "tests" / "data"
PIECES = ["Hello", "WORLD", "camelCase", "HTTPServer", "x", "the", "don't", "I'M", "12345", "3.14", "a/b", "//",
          "\n", "\n\n", "  ", " ", "\t", "é", "Ñandú", "e\u0301", "中文", "😀", "!!", "...", "==>", "foo_bar",
          "Ärger", "ǅ", "ʰ", "ABCdef", "abcDEF", "isTheBest", "getURL", "we're", "한국어", "x=1;", "(a+b)*c"]


def write_gguf(path: Path, meta: dict) -> None:
    """A one-layer Llama with random weights and the tokenizer metadata `meta`."""
    tokens = meta["tokenizer.ggml.tokens"]
    cfg = transformers.LlamaConfig(vocab_size=len(tokens), hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(96)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_token_list(tokens)
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    if "tokenizer.ggml.scores" in meta:
        w.add_token_scores(meta["tokenizer.ggml.scores"])
    if "tokenizer.ggml.merges" in meta:
        w.add_token_merges(meta["tokenizer.ggml.merges"])
    if "tokenizer.ggml.pre" in meta:
        w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    if "tokenizer.ggml.add_space_prefix" in meta:
        w.add_add_space_prefix(meta["tokenizer.ggml.add_space_prefix"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, t in model.state_dict().items():
        arr = t.float().numpy()
        if ".q_proj." in name or ".k_proj." in name:
            arr = _llama_cpp_permute(arr, 4 if ".q_proj." in name else 2)
        parts = name.split(".")
        w.add_tensor(_GGUF_NAMES[name] if name in _GGUF_NAMES else
                     f"blk.{parts[2]}.{_GGUF_NAMES['.'.join(parts[3:-1])]}.{parts[-1]}", arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


class Server:
    def __init__(self, binary: str, model: Path, port: int):
        env = {**os.environ, "LD_LIBRARY_PATH": str(Path(binary).parent)}
        self.proc = subprocess.Popen([binary, "-m", str(model), "--port", str(port), "-c", "256"], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.base = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                urllib.request.urlopen(self.base + "/health")
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("llama-server did not start")

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req).read())

    def tokens(self, text: str) -> list[int]:
        return self.post("/tokenize", {"content": text, "add_special": False})["tokens"]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def random_text(rng: random.Random, pieces: list[str]) -> str:
    return "".join(rng.choice(pieces) + rng.choice(["", " ", ""]) for _ in range(rng.randint(1, 10)))


def spm(binary: str, tmp: Path, port: int, compare: int) -> None:
    out = {"source": "llama.cpp llama-server /tokenize and /detokenize (parse_special on, no BOS) over the "
                     "vocabulary tests/test_gguf_tokenizers.py builds with seed 0 (scripts/gguf_tokenizer_fixtures.py)"}
    specials = ["</s>", "<s>", "<unk>"] + list("abcdefghijklmnopqrstuvwxyz") * 3 + list("  ") * 6 + list(".,!?'-0123")
    for key, prefix in (("cases", True), ("no_space_prefix_cases", False)):
        meta = {**spm_metadata(), "tokenizer.ggml.add_space_prefix": prefix}
        write_gguf(tmp / "spm.gguf", meta)
        server, ours = Server(binary, tmp / "spm.gguf", port), tokenizer_from_gguf_metadata(meta, "spm.gguf")
        try:
            rng = random.Random(7)
            texts = ["", " ", "hello world", " hello", "</s>x", "<s> hi", "x<unk>y", "été 中文 😀"]
            texts += [random_text(rng, specials + PIECES) for _ in range(56 if prefix else 12)]
            out[key] = [{"text": t, "tokens": server.tokens(t),
                         "detokenized": server.post("/detokenize", {"tokens": server.tokens(t)})["content"]}
                        for t in texts]
            if prefix:
                out["bos_hi"] = server.post("/tokenize", {"content": "hi", "add_special": True})["tokens"]
            report(f"sentencepiece (space prefix {prefix})", server, ours, specials + PIECES, compare)
        finally:
            server.close()
    (DATA / "spm_llamacpp_tokens.json").write_text(json.dumps(out, ensure_ascii=False, indent=0))


def byte_level(binary: str, tmp: Path, port: int, compare: int, pre: str, name: str, vocab=lambda m: m) -> None:
    """vocab: how the embedded vocabulary is changed first (with_probe_tokens)."""
    meta, _ = read_gguf_header(default_gguf_path())
    meta = {**vocab(meta), "tokenizer.ggml.pre": pre}
    write_gguf(tmp / f"{name}.gguf", meta)
    ours = tokenizer_from_gguf_metadata(meta, f"{name}.gguf")
    others = [tokenizer_from_gguf_metadata({**meta, "tokenizer.ggml.pre": p}, p)
              for p in ("gpt-2", "qwen2", "llama-bpe", "smollm", "tekken", "deepseek-coder", "gpt-4o", "deepseek-llm")
              if p != pre]
    server = Server(binary, tmp / f"{name}.gguf", port)
    try:
        rng, cases, tried = random.Random(17), [], 0
        while len(cases) < 30 and tried < 20000:  # texts only this split tokenizes this way
            tried += 1
            text = random_text(rng, PIECES)
            mine = ours.encode(text, add_special_tokens=False)
            if all(mine != o.encode(text, add_special_tokens=False) for o in others):
                cases.append({"text": text, "tokens": server.tokens(text)})
        report(pre, server, ours, PIECES, compare)
    finally:
        server.close()
    probes = "with digit runs and words across a change of case added (with_probe_tokens) "
    (DATA / f"{name}_llamacpp_tokens.json").write_text(json.dumps(
        {"source": f"llama.cpp llama-server /tokenize (no BOS) over the embedded SmolLM2 vocabulary and merges "
                   f"{probes if vocab is with_probe_tokens else ''}"
                   f"with tokenizer.ggml.pre {pre!r}; texts whose tokens differ under every other split "
                   f"(scripts/gguf_tokenizer_fixtures.py)", "cases": cases}, ensure_ascii=False, indent=0))


def report(what: str, server: Server, ours, pieces: list[str], n: int) -> None:
    rng, differ = random.Random(5), 0
    for _ in range(n):
        text = random_text(rng, pieces)
        differ += ours.encode(text, add_special_tokens=False) != server.tokens(text)
    print(f"{what}: {differ} of {n} random texts tokenized otherwise than llama.cpp", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-server", required=True, help="a llama.cpp llama-server binary")
    p.add_argument("--port", type=int, default=18600)
    p.add_argument("--compare", type=int, default=1000, help="random texts to compare per tokenizer")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        spm(args.llama_server, Path(tmp), args.port, args.compare)
        byte_level(args.llama_server, Path(tmp), args.port, args.compare, "tekken", "tekken")
        byte_level(args.llama_server, Path(tmp), args.port, args.compare, "deepseek-coder", "deepseek_coder")
        byte_level(args.llama_server, Path(tmp), args.port, args.compare, "gpt-4o", "gpt4o", with_probe_tokens)
        byte_level(args.llama_server, Path(tmp), args.port, args.compare, "deepseek-llm", "deepseek_llm")


if __name__ == "__main__":
    main()
