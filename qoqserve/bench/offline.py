"""Offline throughput: our engine vs transformers' generate, same prompts, one run.

Prompts are random token ids (seeded, distinct per request so the prefix
cache cannot help), outputs run to exactly output_len tokens (EOS ignored),
greedy. Throughput = output tokens / wall time of the whole batch.
"""
from __future__ import annotations

import dataclasses
import gc
import time
from dataclasses import asdict, dataclass

import torch

from qoqserve.config import EngineConfig, parse_dtype
from qoqserve.llm import LLM
from qoqserve.model_loader import load_model_source
from qoqserve.sampling_params import SamplingParams


@dataclass
class BenchResult:
    system: str
    dtype: str
    batch: int
    input_len: int
    output_len: int
    seconds: float
    output_tok_per_s: float


def make_prompts(batch: int, input_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # skip the low ids: special/control tokens live there in most vocabularies
    return torch.randint(100, vocab, (batch, input_len), generator=g).tolist()


def bench_engine(llm, dtype_name: str, batch: int, input_len: int, output_len: int) -> BenchResult:

    prompts = make_prompts(batch, input_len, llm.engine.arch.vocab_size, seed=batch)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(make_prompts(min(batch, 4), input_len, llm.engine.arch.vocab_size, seed=999),
                 SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    produced = sum(len(o.token_ids) for o in outs)
    return BenchResult("qoqserve", dtype_name, batch, input_len, output_len, seconds, produced / seconds)


def load_transformers(source, dtype: torch.dtype):
    """transformers' model of the architecture holding exactly the weights our
    engine loads: its config is the one our checkpoints write (to_hf_config),
    so the two cannot drift apart."""
    # lazy: optional dependency, only for the baseline
    import transformers

    a = source.arch
    fields = a.to_hf_config("float32")
    cfg = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    state = {k: v.to(dtype) for k, v in source.iter_tensors()}
    model.load_state_dict(state, strict=False, assign=True)
    if a.tie_word_embeddings:
        model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)  # buffers off meta
    return model.eval()


def bench_transformers(model, dtype_name: str, batch: int, input_len: int, output_len: int,
                       vocab: int) -> BenchResult:
    ids = torch.tensor(make_prompts(batch, input_len, vocab, seed=batch))
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                  pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:min(batch, 4), :input_len], **{**kwargs, "max_new_tokens": 4,
                                                           "min_new_tokens": 4})
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        seconds = time.perf_counter() - start
    produced = (out.shape[1] - input_len) * batch
    return BenchResult("transformers", dtype_name, batch, input_len, output_len, seconds,
                       produced / seconds)


def run_offline(config: EngineConfig, dtypes: list[str], batches: list[int], input_len: int,
                output_len: int, compare_transformers: bool) -> list[BenchResult]:
    """config: the engine options of every run; its dtype is replaced by each of `dtypes`."""
    results = []
    model = config.model
    for dtype_name in dtypes:
        llm = LLM.from_config(dataclasses.replace(config, dtype=dtype_name))
        for b in batches:
            results.append(bench_engine(llm, dtype_name, b, input_len, output_len))
            print(_fmt(results[-1]), flush=True)
        del llm
        gc.collect()
        if compare_transformers:
            source = load_model_source(model)
            hf = load_transformers(source, parse_dtype(dtype_name, "cpu"))
            for b in batches:
                results.append(bench_transformers(hf, dtype_name, b, input_len, output_len,
                                                  source.arch.vocab_size))
                print(_fmt(results[-1]), flush=True)
            del hf
            gc.collect()
    return results


def _fmt(r: BenchResult) -> str:
    return (f"{r.system:<13} {r.dtype:<9} batch {r.batch:>3}  in {r.input_len} out {r.output_len}  "
            f"{r.seconds:7.2f} s  {r.output_tok_per_s:8.1f} tok/s")


def as_dicts(results: list[BenchResult]) -> list[dict]:
    return [asdict(r) for r in results]
