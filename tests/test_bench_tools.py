"""The benchmark tools measure what they claim: memory plans equal what the
engine holds, the throughput protocol fills the budget, the load generator
counts what the server sent."""
from __future__ import annotations

import pytest

from qoqserve.bench.memory import plan_memory
from qoqserve.bench.precisions import engine_kwargs, get_precision, model_for
from qoqserve.llm import LLM
from qoqserve.model_loader import load_model_source


@pytest.mark.parametrize("precision,model", [
    ("fp32", None), ("bf16", None), ("w8a8", None),
    ("w4a8kv4", "synthetic:tiny"), ("w4a8kv8", "synthetic:tiny"), ("w4a8", "synthetic:tiny")])
def test_memory_plan_equals_what_the_engine_holds(precision, model):
    p = get_precision(precision)
    path = model_for(p, model)
    src = load_model_source(path)
    plan = plan_memory(src.arch, p, "cpu", seq_len=100, budget_bytes=2**24,
                       group_size=getattr(src.quant_config, "group_size", 128))
    llm = LLM(path, kv_cache_gb=2**24 / 2**30, **engine_kwargs(p, "cpu"))
    stats = llm.engine.stats()
    assert plan.linear_weight_bytes == stats["linear_weight_bytes"]
    assert plan.kv_bytes_per_token == stats["kv_bytes_per_token"]
    assert plan.num_pages == stats["num_kv_blocks"]
    assert stats["weight_bytes"] == plan.weight_bytes  # + embeddings, norms, RoPE tables


def test_w4a8_precisions_refuse_full_precision_checkpoints_and_vice_versa(default_gguf_path):
    with pytest.raises(ValueError, match="needs a QoQ checkpoint"):
        model_for(get_precision("w4a8kv4"), default_gguf_path)
    with pytest.raises(ValueError, match="QoQ checkpoint"):
        model_for(get_precision("bf16"), "qoq")
    with pytest.raises(ValueError, match="not implemented"):
        get_precision("w4a16")


def test_throughput_protocol_fills_the_memory_budget():
    from qoqserve.bench.throughput import bench_throughput

    results = bench_throughput("synthetic:tiny", ["fp32", "w4a8kv4"], input_len=24, output_len=8,
                               memory_gb=0.0022, max_batch=64)
    fp, kv4 = results
    for r in results:
        assert r.batch >= 1 and r.output_tok_per_s > 0 and r.seconds > 0
    # the same budget holds more KV4 sequences: smaller weights and 4-bit pages
    assert kv4.batch > 2 * fp.batch
    assert kv4.kv_bytes_per_token < 0.3 * fp.kv_bytes_per_token * 2  # int4 vs fp32 pages


def test_load_generator_counts_tokens_and_latencies(server):
    from qoqserve.bench.serve import LoadConfig, run_load

    cfg = LoadConfig(base_url=server.base, api_key=server.api_key, num_requests=12, concurrency=4,
                     input_words=20, output_len=6, input_jitter=0.5)
    s = run_load(cfg, progress=False)
    assert s["completed"] == 12 and s["failed"] == 0
    assert s["output_tokens"] == 12 * 6  # EOS ignored: exactly max_tokens each
    assert 12 * 20 * 0.5 < s["prompt_tokens"]
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        d = s[key]
        assert 0 < d["p50"] <= d["p90"] <= d["p99"] <= d["max"]
    assert s["e2e_s"]["mean"] > s["ttft_s"]["mean"]
    chat = run_load(LoadConfig(base_url=server.base, api_key=server.api_key, endpoint="chat",
                               num_requests=4, concurrency=None, request_rate=20.0, output_len=4),
                    progress=False)
    assert chat["completed"] == 4 and chat["output_tokens"] == 16
    # a mixed load: the long-prompt clients run beside, the summary is the main load's
    mixed = run_load(LoadConfig(base_url=server.base, api_key=server.api_key, num_requests=4, concurrency=2,
                                input_words=10, output_len=5, long_streams=1, long_input_words=200),
                     progress=False)
    assert mixed["completed"] == 4 and mixed["output_tokens"] == 20
    assert mixed["prompt_tokens"] < 4 * 60  # none of the ~260-token long prompts counted
    # penalties and logprobs reach the server (an out-of-range one would fail every request)
    for endpoint in ("completions", "chat"):
        asked = run_load(LoadConfig(base_url=server.base, api_key=server.api_key, endpoint=endpoint,
                                    num_requests=2, concurrency=2, output_len=3, repetition_penalty=1.2,
                                    logprobs=2), progress=False)
        assert asked["completed"] == 2 and asked["output_tokens"] == 6
    bad = run_load(LoadConfig(base_url=server.base, api_key=server.api_key, num_requests=1, concurrency=1,
                              output_len=3, logprobs=99), progress=False)
    assert bad["failed"] == 1


def test_plots_are_written_as_png(tmp_path):
    from qoqserve.bench.plots import plot_latency_vs_load, plot_throughput_vs_batch

    rows = [{"precision": p, "batch": b, "decode_tok_per_s": b * k} for p, k in (("bf16", 10), ("w4a8kv4", 25))
            for b in (1, 8, 32)]
    plot_throughput_vs_batch(rows, str(tmp_path / "t.png"))

    def summary(c, ms):
        pct = {"mean": ms, "p50": ms, "p90": ms * 1.5, "p99": ms * 2}
        return {"config": {"concurrency": c, "request_rate": None}, "ttft_s": pct, "tpot_s": pct}
    plot_latency_vs_load({"ours": [summary(c, c * 1e-3) for c in (1, 8, 32)],
                          "peer": [summary(c, c * 2e-3) for c in (1, 8, 32)]}, str(tmp_path / "l.png"))
    for name in ("t.png", "l.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
