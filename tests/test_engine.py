"""Engine behaviour on the embedded model: batch invariance, preemption,
prefix caching, page accounting, stop conditions, bad input."""
import gc

import pytest

from qoqserve.errors import InvalidRequestError
from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams

TOPICS = ["the sea", "a mountain village", "how batteries work", "a cat named Pixel",
          "the history of paper", "why the sky is blue", "a robot learning to paint",
          "winter in the city", "the first day of school", "a lighthouse keeper",
          "prime numbers", "a recipe for bread", "the moon landing", "a lost umbrella",
          "trains at night", "how bees make honey"]
SYSTEM = ("You are a careful assistant. Answer in plain English, in short sentences, "
          "and never use lists. ")


def batch_prompts():
    """16 prompts of mixed lengths; half share a 3-page system prompt."""
    mixed = [f"Tell me about {t}." + " Please be specific and concrete." * (i % 4)
             for i, t in enumerate(TOPICS[:8])]
    shared = [SYSTEM * 3 + f"Question {i}: tell me about {t}." for i, t in enumerate(TOPICS[8:])]
    return [p for pair in zip(mixed, shared) for p in pair]


GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def tokens(outs):
    return [o.token_ids for o in outs]


def free_llm(llm):
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def reference():
    """Each prompt alone, on an engine without prefix caching."""
    llm = LLM(dtype="float32", kv_cache_gb=0.25, enable_prefix_caching=False)
    ref = {}
    for p in batch_prompts():
        ref[p] = llm.generate([p], GREEDY)[0].token_ids
    yield ref
    free_llm(llm)


def check_all_pages_free(llm):
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.used_ids
    assert not llm.engine.trackers and not llm.engine.has_unfinished()


def test_batch_of_16_matches_each_prompt_alone(reference):
    llm = LLM(dtype="float32", kv_cache_gb=0.25, enable_prefix_caching=False)
    prompts = batch_prompts()
    assert len({len(llm.tokenizer.encode(p)) for p in prompts}) >= 8
    outs = llm.generate(prompts, GREEDY)
    assert tokens(outs) == [reference[p] for p in prompts]
    check_all_pages_free(llm)
    free_llm(llm)


def test_prefix_cache_hits_do_not_change_outputs(reference):
    llm = LLM(dtype="float32", kv_cache_gb=0.25, enable_prefix_caching=True)
    prompts = batch_prompts()
    first = llm.generate(prompts[1:2], GREEDY)   # fills the cache with the system prompt
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.stats()["prefix_cache_hits"] > 0
    assert all(outs[i].num_cached_tokens >= 48 for i in range(1, 16, 2))
    assert tokens(first) + tokens(outs) == [reference[p] for p in prompts[1:2] + prompts]
    check_all_pages_free(llm)
    free_llm(llm)


def test_preemption_by_recompute_keeps_outputs(reference):
    # 12 pages of 16 tokens: room for a few sequences, so decode must preempt
    llm = LLM(dtype="float32", num_blocks=12, block_size=16)
    prompts = batch_prompts()
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.stats()["num_preemptions"] > 0
    assert tokens(outs) == [reference[p] for p in prompts]
    check_all_pages_free(llm)
    free_llm(llm)


@pytest.fixture(scope="module")
def llm():
    engine = LLM(dtype="float32", kv_cache_gb=0.25)
    yield engine
    free_llm(engine)


def test_abort_frees_pages(llm):
    engine = llm.engine
    for i, p in enumerate(batch_prompts()[:6]):
        engine.add_request(f"abort-{i}", p, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    for i in range(6):
        assert engine.abort(f"abort-{i}")
    assert not engine.abort("abort-0")
    check_all_pages_free(llm)


def test_streamed_deltas_add_up_and_stop_strings_cut(llm):
    engine = llm.engine
    prompt = "Count from one to twenty in words, separated by commas: one, two,"
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40))[0].text
    assert " five" in full
    engine.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=40, stop=[" five"]))
    pieces, last = [], None
    while engine.has_unfinished():
        for out in engine.step():
            pieces.append(out.delta_text)
            last = out
    assert last.finished and last.finish_reason == "stop"
    assert "".join(pieces) == last.text == full[:full.index(" five")]
    check_all_pages_free(llm)


def test_stop_token_ids_max_tokens_eos(llm):
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=5))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    stop_tok = out.token_ids[2]
    out2 = llm.generate(["The capital of France is"],
                        SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[stop_tok]))[0]
    assert out2.finish_reason == "stop" and out2.token_ids == out.token_ids[:3]
    chat = llm.chat([{"role": "user", "content": "Say hello."}],
                    SamplingParams(temperature=0, max_tokens=60))[0]
    assert chat.finish_reason == "stop" and chat.token_ids[-1] in llm.engine.eos_ids
    assert "<|im_end|>" not in chat.text


def test_logprobs_and_seeded_sampling(llm):
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, logprobs=True)
    a = llm.generate(["Once upon a time"], p)[0]
    b = llm.generate(["Once upon a time", "Hello"], [p, SamplingParams(temperature=1.0)])[0]
    assert a.token_ids == b.token_ids
    assert len(a.logprobs) == 12 and all(lp <= 0 for lp in a.logprobs)
    other = llm.generate(["Once upon a time"], SamplingParams(temperature=0.8, top_p=0.9, seed=8,
                                                             max_tokens=12))[0]
    assert other.token_ids != a.token_ids
    greedy = llm.generate(["Once upon a time"],
                          SamplingParams(temperature=0, max_tokens=4, logprobs=True))[0]
    assert all(-5 < lp <= 0 for lp in greedy.logprobs)


def test_bad_requests_are_refused_clearly(llm):
    engine = llm.engine
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("e", "")
    long_prompt = list(range(100, 100 + engine.max_model_len))
    with pytest.raises(InvalidRequestError, match="context window"):
        engine.add_request("l", long_prompt)
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request("v", [1, 2, 10**9])
    engine.add_request("dup", "hi", SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("dup", "hi")
    engine.abort("dup")
    check_all_pages_free(llm)
