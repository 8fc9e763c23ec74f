"""The embedded SmolLM2-135M-Instruct through our engine vs transformers."""
import math

import pytest
import torch

from qoqserve.eval.perplexity import LICENSE_TEXTS, perplexity, read_texts
from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", kv_cache_gb=0.1)


def test_logits_match_transformers(llm, hf_gguf_model):
    ids = llm.tokenizer.encode(read_texts(LICENSE_TEXTS[1:])[:2000])[:300]
    ours = llm.engine.prompt_logprobs(ids)
    with torch.inference_mode():
        logits = hf_gguf_model(torch.tensor([ids])).logits[0, :-1].float()
    ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    # fp32 on both sides; only summation order differs
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=0)
    assert ref.std() > 0.5
    # the scored pass ran over scratch pages (C prefill kernel), gave them back,
    # and agrees with the uncached pass (fp64 torch attention)
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_kv_blocks"]
    torch.testing.assert_close(ours, llm.engine.runner.prompt_logprobs(ids), atol=1e-4, rtol=0)


def test_greedy_generation_matches_transformers(llm, hf_gguf_model):
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Explain what a compiler does."}])
    ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
    ours = llm.generate([ids], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    with torch.inference_mode():
        ref = hf_gguf_model.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24,
                                     do_sample=False, attention_mask=torch.ones(1, len(ids)))
    assert ours.token_ids == ref[0, len(ids):].tolist()


def _hf_chunked_ppl(model, ids, window):
    nll, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor([ids[start:start + window]])
            if chunk.shape[1] < 2:
                break
            loss = model(input_ids=chunk, labels=chunk).loss.item()  # mean over chunk-1 tokens
            nll += loss * (chunk.shape[1] - 1)
            count += chunk.shape[1] - 1
    return math.exp(nll / count), count


def test_perplexity_on_license_texts_matches_transformers(llm, hf_gguf_model):
    # 4 windows of 512: the engine's whole prompt path against transformers, at
    # a sixth of the texts' cost (docs/accuracy.md scores all of them)
    ids = llm.tokenizer.encode(read_texts(LICENSE_TEXTS))[:2048]
    ours = perplexity(llm.engine.prompt_logprobs, ids, window=512, stride=512)
    ref, count = _hf_chunked_ppl(hf_gguf_model, ids, 512)
    assert ours.num_tokens == count
    assert abs(ours.ppl / ref - 1) < 0.005, (ours.ppl, ref)
    assert 5 < ours.ppl < 60  # sane for a 135M chat model on legal English


def test_sliding_window_scores_each_token_once(llm):
    ids = llm.tokenizer.encode(read_texts(LICENSE_TEXTS[1:]))[:700]
    res = perplexity(llm.engine.prompt_logprobs, ids, window=256, stride=128)
    assert res.num_tokens == len(ids) - 1
    disjoint = perplexity(llm.engine.prompt_logprobs, ids, window=256, stride=256)
    # more context per scored token -> lower perplexity
    assert res.ppl < disjoint.ppl
