"""Prometheus metrics under vLLM's names, so existing dashboards work unchanged.

Gauges and counters are read from the engine thread's stats snapshot at
scrape time; latency histograms are observed when a request finishes.
"""
from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from qoqserve.engine.output import RequestOutput

disable_created_metrics()  # the *_created series only add noise to every scrape

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)

# (metric, stats key, help); counters get the _total suffix from prometheus_client
_GAUGES = [
    ("vllm:num_requests_running", "num_running", "Number of requests in model execution batches."),
    ("vllm:num_requests_waiting", "num_waiting", "Number of requests waiting to be processed."),
    ("vllm:kv_cache_usage_perc", "kv_usage", "KV-cache usage. 1 means 100 percent usage."),
    ("qoqserve:kv_cache_free_blocks", "num_free_blocks", "Free KV pages."),
    ("qoqserve:kv_cache_total_blocks", "num_kv_blocks", "KV pages in the pool."),
    ("qoqserve:kv_cache_bytes_per_token", "kv_bytes_per_token",
     "KV bytes per token of the layers that keep every page."),
    ("qoqserve:window_kv_cache_free_blocks", "num_free_window_blocks",
     "Free KV pages of the sliding-window layers' own pool (where they have one)."),
    ("qoqserve:weight_bytes", "weight_bytes", "Resident bytes of the model's parameters and buffers."),
]
_COUNTERS = [
    ("vllm:prompt_tokens", "prompt_tokens", "Number of prefill tokens processed."),
    ("vllm:generation_tokens", "generation_tokens", "Number of generation tokens processed."),
    ("vllm:num_preemptions", "num_preemptions", "Cumulative number of preemptions."),
    ("vllm:prefix_cache_queries", "prefix_cache_queries", "Prefix-cache queries, in tokens."),
    ("vllm:prefix_cache_hits", "prefix_cache_hits", "Prefix-cache hits, in tokens."),
    ("qoqserve:decode_bursts", "decode_bursts", "Decode bursts run (several greedy decode steps at once)."),
    ("vllm:spec_decode_num_drafts", "spec_decode_num_drafts", "Number of spec decoding drafts."),
    ("vllm:spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", "Number of draft tokens."),
    ("vllm:spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens", "Number of accepted tokens."),
]


class _SnapshotCollector:
    def __init__(self, get_stats, model_name: str):
        self.get_stats = get_stats
        self.model_name = model_name

    def collect(self):
        stats = self.get_stats()
        for name, key, doc in _GAUGES:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.model_name], float(stats.get(key) or 0))
            yield g
        for name, key, doc in _COUNTERS:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self.model_name], float(stats.get(key, 0)))
            yield c


class ServerMetrics:
    def __init__(self, model_name: str, get_stats):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_SnapshotCollector(get_stats, model_name))
        labels = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token.",
                              labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("vllm:time_per_output_token_seconds",
                              "Histogram of mean time per output token of each request.",
                              labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of end-to-end latency.",
                             labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.queue_time = Histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in the waiting queue.",
                                    labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.prefill_time = Histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time from first scheduled to first token "
                                      "(the prefill, in chunks).",
                                      labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.success = Counter("vllm:request_success", "Count of finished requests.",
                               labels + ["finished_reason"], registry=self.registry)

    def on_step(self, engine, outputs: list[RequestOutput]) -> None:
        """Engine-thread hook: observe the latencies of requests that just finished."""
        for out in outputs:
            if not out.finished:
                continue
            m = out.metrics
            arrival, first, done = m.get("arrival_time"), m.get("first_token_time"), m.get("finished_time")
            scheduled = m.get("scheduled_time")
            if arrival is not None and scheduled is not None:
                self.queue_time.labels(self.model_name).observe(scheduled - arrival)
            if scheduled is not None and first is not None:
                self.prefill_time.labels(self.model_name).observe(first - scheduled)
            if arrival is not None and first is not None:
                self.ttft.labels(self.model_name).observe(first - arrival)
            if first is not None and done is not None and len(out.token_ids) > 1:
                self.tpot.labels(self.model_name).observe((done - first) / (len(out.token_ids) - 1))
            if arrival is not None and done is not None:
                self.e2e.labels(self.model_name).observe(done - arrival)
            self.success.labels(self.model_name, out.finish_reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
