"""Chunked prefill: a prompt's greedy output does not depend on how it was cut
into chunks (fp32, bf16, W4A8KV4) nor on what shared its steps (decodes, other
chunks: fp32 and W4A8KV4; bf16 where its linears all run the C kernel, which
is batch-invariant: not on AVX-512 CPUs without BF16 dot products, where
oneDNN's bf16 GEMM runs), with prefix-cache hits and across preemption."""
import gc

import pytest

from qoqserve.layers.quantization import fp
from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams

PROMPTS = ["The three primary colors are", "Write a short poem about the sea and the wind.",
           "def fibonacci(n):\n    " * 3, "Explain why the sky is blue in " + "very " * 20 + "simple words."]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=True)




def _generate(llm, prompts, budget, threshold=None, params=GREEDY):
    """Greedy outputs under a given step budget (and per-prompt chunk cap)."""
    sched = llm.engine.scheduler
    sched.max_num_batched_tokens, sched.long_prefill_token_threshold = budget, threshold
    outs = llm.generate(prompts, params)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.has_unfinished()
    return [o.token_ids for o in outs], [o.logprobs for o in outs]


def _run(model, prompts, budget, **kw):
    llm = LLM(model, kv_cache_gb=0.05, **kw)
    tokens, lps = _generate(llm, prompts, budget)
    stats = llm.engine.stats()
    del llm
    gc.collect()
    return tokens, lps, stats


CASES = {"fp32": (None, dict(dtype="float32")), "bf16": (None, dict(dtype="bfloat16")),
         "w4a8kv4": ("qoq", dict(dtype="float32"))}


@pytest.mark.parametrize("case", list(CASES))
def test_chunk_sizes_alone_and_in_a_batch_give_the_whole_prompt_output(case, qoq_tiny):
    model, kw = CASES[case]
    model = qoq_tiny if model == "qoq" else model
    prompts = PROMPTS if model is None else [[5 + i * 7 + j for j in range(20 + 9 * i)] for i in range(4)]
    llm = LLM(model, kv_cache_gb=0.05, enable_prefix_caching=False, **kw)
    whole = [_generate(llm, [p], 4096) for p in prompts]
    ref_tokens, ref_lps = [w[0][0] for w in whole], [w[1][0] for w in whole]
    for chunk in (1, 7, 64):
        # the same bits: chunk 1 ends in a 1-token chunk, prefilled as the
        # whole prompt's last token is (tests/test_block_manager.py)
        alone = [_generate(llm, [p], chunk) for p in prompts[:2]]
        assert [a[0][0] for a in alone] == ref_tokens[:2], f"chunk {chunk} alone"
        if case == "bf16" and not fp.bf16_all_on_c():
            # bf16 is not batch-invariant here (docs/runtime.md): its tokens
            # are checked alone, not its bits nor what shares its steps
            continue
        assert [a[1][0] for a in alone] == ref_lps[:2], f"chunk {chunk} alone"
        # all four at once: decodes of the finished prompts share steps with the chunks of the others
        tokens, lps = _generate(llm, prompts, max(chunk, 7), threshold=chunk)
        assert tokens == ref_tokens, f"chunk {chunk} in a batch"
        assert lps == ref_lps, f"chunk {chunk} in a batch"


@pytest.mark.parametrize("case", list(CASES))
def test_prefix_hits_and_preemption_with_chunks_keep_outputs(case, qoq_tiny):
    if case == "bf16" and not fp.bf16_all_on_c():
        pytest.skip("bf16 linears run oneDNN here, not batch-invariant (the test below holds bf16 to less)")
    model, kw = CASES[case]
    model = qoq_tiny if model == "qoq" else model
    if model is None:
        shared = "You are a careful assistant. Answer in plain English, in short sentences. " * 4
        prompts = [shared + f"Question {i}: tell me about {t}." for i, t in
                   enumerate(["the sea", "bees", "trains", "paper", "the moon", "bread"])]
    else:  # the tiny model's vocabulary: 4 shared pages, then ~1 page of each prompt's own
        shared = [3 + (j * 11) % 200 for j in range(64)]
        prompts = [shared + [7 + i * 13 + j for j in range(10 + 3 * i)] for i in range(6)]
    ref_llm = LLM(model, kv_cache_gb=0.05, enable_prefix_caching=False, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    alone = [_generate(ref_llm, [p], 4096, params=params)[0][0] for p in prompts]
    del ref_llm
    # 12 pages of 16 tokens: the shared prefix (4 pages) plus ~3 own pages each for six
    # sequences do not fit: preemption
    llm = LLM(model, num_blocks=12, max_num_batched_tokens=32, enable_prefix_caching=True, **kw)
    outs = llm.generate(prompts, params)
    stats = llm.engine.stats()
    assert [o.token_ids for o in outs] == alone
    assert stats["prefix_cache_hits"] > 0 and stats["num_preemptions"] > 0, stats
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_bf16_prefix_hits_with_chunks_keep_outputs():
    """Where bf16 linears run oneDNN they are not batch-invariant
    (docs/runtime.md), so bf16 is held everywhere to its whole-prompt output
    one prompt at a time: the later prompts hit the first one's cached prefix
    and are prefilled in 32-token chunks."""
    shared = "You are a careful assistant. Answer in plain English, in short sentences. " * 4
    prompts = [shared + f"Question {i}: tell me about {t}." for i, t in enumerate(["the sea", "bees", "trains"])]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref_llm = LLM(None, dtype="bfloat16", kv_cache_gb=0.05, enable_prefix_caching=False)
    alone = [_generate(ref_llm, [p], 4096, params=params)[0][0] for p in prompts]
    del ref_llm
    llm = LLM(None, dtype="bfloat16", kv_cache_gb=0.05, max_num_batched_tokens=32, enable_prefix_caching=True)
    got = [_generate(llm, [p], 32, params=params)[0][0] for p in prompts]
    assert got == alone
    assert llm.engine.stats()["prefix_cache_hits"] > 0


def test_a_prompt_longer_than_the_budget_is_served():
    prompt = "Tell me a long story about a lighthouse keeper. " * 12  # ~130 tokens
    ref, _, _ = _run(None, [prompt], 4096, dtype="float32")
    got, _, stats = _run(None, [prompt], 16, dtype="float32")
    assert got == ref and stats["prompt_tokens"] >= 100
