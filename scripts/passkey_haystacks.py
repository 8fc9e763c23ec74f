"""Pass-key accuracy of FP32 and the QoQ engine (cached default checkpoint,
KV4 pages) on harder haystacks than eval/filler.py's: its narrative with a
share of sentences carrying 5-digit distractor numbers, or the license
texts' prose. Same cases and scoring as `qoqserve eval quality`.

    python scripts/passkey_haystacks.py distractors 0.15
    python scripts/passkey_haystacks.py licenses
"""
import re
import sys
import time

import qoqserve.eval.filler as filler
from qoqserve.eval import retrieval
from qoqserve.eval.perplexity import LICENSE_TEXTS, read_texts
from qoqserve.llm import LLM


def with_distractors(share: float):
    plain = filler._sentence

    def sentence(rng):
        if rng.random() < share:
            return (f"{rng.choice(filler._SUBJECTS).capitalize()} counted {rng.randint(10000, 99999)} "
                    f"{rng.choice(['coins', 'stones', 'apples', 'steps', 'letters'])} {rng.choice(filler._TAILS)}.")
        return plain(rng)
    filler._sentence = sentence


def license_prose():
    text = re.sub(r"\s+", " ", read_texts(LICENSE_TEXTS))
    sents = [s + " " for s in re.split(r"(?<=[.;:])\s+", text) if s.strip()]

    def pieces(tok, n, seed):
        out, counts, i = [], [], seed % len(sents)
        while True:
            s = sents[i % len(sents)]
            i += 1
            c = len(tok.encode(s.rstrip(" "), add_special_tokens=False))
            if sum(counts) + c > n:
                return out, counts
            out.append(s)
            counts.append(c)
    retrieval.filler_pieces = pieces


def main():
    if sys.argv[1] == "distractors":
        with_distractors(float(sys.argv[2]))
    else:
        license_prose()
    start = time.time()
    for name, path, kw in (("FP32", None, dict(dtype="float32")),
                           ("QoQ g64 engine", "qoq", dict(quantized_prefill=True))):
        llm = LLM(path, kv_cache_gb=0.25, **kw)
        cases = retrieval.build_cases(llm.tokenizer, (1024, 2048), keys_per_depth=2)
        acc = retrieval.passkey_accuracy(llm.engine.prompt_logits, cases)
        print(name, {k: f"{sum(1 for c in cases if c.length == k) * v:.0f}/"
                     f"{sum(1 for c in cases if c.length == k)}" for k, v in acc.items()},
              f"{time.time() - start:.0f} s", flush=True)
        del llm


if __name__ == "__main__":
    main()
