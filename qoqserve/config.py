"""Engine configuration: one dataclass per concern, gathered in EngineConfig.

These dataclasses are the one place engine options and their defaults are
written: the command line's engine flags are generated from their fields
(qoqserve/cli/config_args.py), with the help text from each field's metadata.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import torch

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16}
DTYPE_CHOICES = ("auto", *_DTYPES)
KV_CACHE_DTYPES = ("auto", "int4", "int8", "float16", "fp16", "bfloat16", "bf16", "float32")
KERNELS = ("auto", "torch", "cpu", "triton")
W4A8_BACKENDS = ("auto", "packed", "torch-int8", "torch-int8-percall", "sim", "triton")
QUANTIZATIONS = ("w8a8",)
LM_HEAD_DTYPES = ("auto", "int8", "float")


def opt(default, help: str, **extra):
    """A config field with the help text (and optional argparse choices/flags)
    its command-line flag shows."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("mutable defaults need default_factory")
    return field(default=default, metadata={"help": help, **extra})


def json_object(value: str | dict | None, name: str) -> dict | None:
    """An option that holds a JSON object: the flag's text, or a dict from the
    Python API (None stays None); ValueError naming the option."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{name} is not JSON: {e}") from None
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {value!r}")
    return value


def parse_dtype(name: str | torch.dtype, device: str) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        # CPUs here have fast fp32 and bf16 but slow fp16; GPUs want half precision.
        return torch.float32 if device == "cpu" else torch.float16
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose from auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


@dataclass
class CacheConfig:
    block_size: int = opt(16, "tokens per KV page")
    # zero-filling a huge pool costs seconds of start-up and CPU batches are small
    kv_cache_gb: float | None = opt(None, "KV page pool size in GiB (default: --kv-cache-fraction "
                                          "of free memory, capped at 2 GiB on CPU)")
    kv_cache_fraction: float = opt(0.3, "KV pool as a fraction of free memory when --kv-cache-gb "
                                        "is not given (on CUDA: after the weights)")
    gpu_memory_utilization: float | None = opt(
        None, "vLLM's: on CUDA, the share of the GPU's whole memory the engine may fill (weights "
              "already loaded and other processes count against it); the KV pool gets the rest; "
              "in place of --kv-cache-fraction")
    num_blocks: int | None = opt(None, "number of KV pages (overrides the budget; tests use tiny pools)",
                                 cli=False)
    kv_cache_dtype: str = opt("auto", "auto: int4 for QoQ KV4 checkpoints (int8 for KV8 ones), "
                                      "else the model dtype", choices=KV_CACHE_DTYPES)
    enable_prefix_caching: bool = opt(True, "reuse KV pages of shared prompt prefixes",
                                      aliases=("--no-prefix-caching",))
    disable_hybrid_kv_cache_manager: bool = opt(
        False, "vLLM's: where a model mixes sliding-window and full-attention layers (Gemma 2 and 3), "
               "keep every page of the sliding layers too, in one pool, instead of a pool of their own "
               "the size of their windows (llama.cpp's --swa-full)")
    # a prompt whose prefix comes from the prefix cache can only see stored values
    quantized_prefill: bool | None = opt(
        None, "prefill attends to K/V as stored (e.g. KV4) instead of as computed (default: "
              "whenever the page format is lossier than the activations)", cli=False)


@dataclass
class SchedulerConfig:
    max_num_seqs: int = opt(64, "most sequences in one step")
    max_num_batched_tokens: int = opt(2048, "token budget of one step: decodes first, then "
                                            "prompt chunks (a longer prompt is prefilled over "
                                            "several steps)")
    long_prefill_token_threshold: int | None = opt(None, "most tokens one prompt may take of a "
                                                         "step's budget (default: all of it)")
    max_model_len: int | None = opt(None, "context window (default: the model's)")
    max_prompt_tokens: int | None = opt(None, "longest prompt accepted (default: the context "
                                              "window minus one)")
    max_tokens_limit: int | None = opt(None, "largest max_tokens accepted (default: the context window)")
    scheduling_policy: str = opt("fcfs", "fcfs: requests in arrival order; priority: by each request's "
                                          "priority (lower first, vLLM's), then arrival, and a full page pool "
                                          "preempts the lowest priority first", choices=("fcfs", "priority"))
    num_scheduler_steps: int = opt(8, "most decode steps run back to back in one burst when every "
                                      "running request decodes greedily and none waits (1: never; "
                                      "engine/burst.py)")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = opt(1, "split every layer over N ranks (tensor parallelism, "
                                       "docs/parallel.md): N-1 worker processes are started here, "
                                       "or under torchrun every rank is one of its processes",
                                    short=("-tp",))
    distributed_timeout_s: float = opt(120.0, "a collective of a step that takes longer (a stuck "
                                              "rank) fails the engine instead of hanging it")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, as vLLM's --speculative-config takes it (only its
    draft-free "ngram" method: engine/speculative.py)."""
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5

    @classmethod
    def parse(cls, value: str | dict | None) -> SpeculativeConfig | None:
        """From the flag's JSON text or a dict (None: off); ValueError naming what is wrong.
        vLLM's defaults: both lookup bounds 5, or the one given for the other."""
        value = json_object(None if value == "" else value, "speculative_config")
        if value is None:
            return None
        unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {sorted(unknown)}; this engine takes "
                             f"{[f.name for f in dataclasses.fields(cls)]}")
        if value.get("method", "ngram") != "ngram":
            raise ValueError(f"speculative_config: method {value.get('method')!r} is not supported; "
                             "only \"ngram\" (draft tokens looked up in the context) is")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        lo, hi = (5, 5) if lo is None and hi is None else (lo if lo is not None else hi, hi if hi is not None else lo)
        for name, v, most in (("num_speculative_tokens", value["num_speculative_tokens"], 32),
                              ("prompt_lookup_min", lo, 64), ("prompt_lookup_max", hi, 64)):
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= most:
                raise ValueError(f"speculative_config: {name} must be an integer in [1, {most}], got {v!r}")
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min {lo} > prompt_lookup_max {hi}")
        return cls("ngram", value["num_speculative_tokens"], hi, lo)


@dataclass
class EngineConfig:
    model: str | None = opt(None, "HF checkpoint dir, .gguf file or cached Hugging Face id (default: embedded "
                                  "SmolLM2-135M-Instruct), or an alias of that model quantized on "
                                  "first use: qoq (QoQ g64), qoq-tuned (g64 with the long scale tuning), qoq-chn")
    tokenizer: str | None = opt(None, "another tokenizer than the model's: an HF tokenizer directory, a "
                                      "cached Hugging Face id or a .gguf (vLLM's flag; e.g. for a GGUF whose "
                                      "own is not built from its metadata)")
    dtype: str | torch.dtype = opt("auto", "activation and unquantized-weight dtype (auto: fp32 "
                                           "on CPU, fp16 on CUDA)", choices=DTYPE_CHOICES)
    device: str = opt("cpu", "cpu or cuda[:N]")
    w4a8_backend: str = opt(
        "auto", "how QoQ W4A8 linears run: 4-bit codes unpacked in registers by the C VNNI "
                "kernel (packed, 0.5 B/weight; auto picks it on CPUs with AVX-512 VNNI), INT8 weights "
                "expanded at load (torch-int8, 1 B/weight), expanded per call from packed codes "
                "(torch-int8-percall), the fp32 simulation (sim), or the Triton GEMM (triton; auto "
                "picks it on CUDA)",
        choices=W4A8_BACKENDS)
    kernels: str = opt(
        "auto", "auto: Triton kernels on CUDA; on CPU the C kernels (built on first use) where "
                "they build; torch: torch ops only; triton on CPU runs only in Triton's "
                "interpreter (TRITON_INTERPRET=1, for tests)", choices=KERNELS)
    quantization: str | None = opt(None, "quantize a full-precision checkpoint at load (W8A8 "
                                         "baseline); QoQ W4A8 needs a `qoqserve quantize` checkpoint",
                                   choices=QUANTIZATIONS)
    lm_head_dtype: str = opt("auto", "LM head weights: float (the model's; on CPU a lossless "
                                     "bf16/fp16 copy where one exists), int8 (per-channel INT8 "
                                     "weights, INT8 activations: half of bf16's bytes, at a small "
                                     "perplexity cost: docs/accuracy.md), or auto: int8 for QoQ "
                                     "checkpoints on the CPU kernels, float otherwise",
                             choices=LM_HEAD_DTYPES)
    # the first decode step pays the compile (tens of seconds on a small CPU, cached on
    # disk afterwards); every batch size above one shares its graph (attention_backends.py)
    compile: bool = opt(False, "torch.compile the decode attention of the torch path")
    enforce_eager: bool = opt(False, "run every step op by op: no captured decode steps (recorded C "
                                     "calls on CPU, CUDA graphs on CUDA; docs/runtime.md)")
    capture_sizes: str | list[int] | None = opt(
        None, "decode batch sizes to capture, comma-separated (default: 1-8, then every 8 up to "
              "--max-num-seqs); a batch runs in the next larger captured size")
    seed: int = opt(0, "seed of the sampler for requests without their own")
    chat_template: str | None = opt(
        None, "Jinja chat template in place of the model's own (needed for models without one): a "
              "file, or the template itself (text holding '{', '}' or a newline)")
    generation_config: str = opt(
        "auto", "sampling defaults for what a request leaves out (vLLM's flag): auto, the model's "
                "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
                "max_new_tokens); vllm, none; or a folder holding a generation_config.json")
    override_generation_config: str | dict | None = opt(
        None, 'sampling defaults set over --generation-config\'s, a JSON object such as {"temperature": 0.5}')
    structured_outputs_max_whitespace: int = opt(
        8, "JSON constrained by a schema or json_object: most whitespace characters between two "
           "of its tokens, so a small model cannot pad a gap with newlines until max_tokens "
           "(docs/server.md); 0: unbounded, as vLLM")
    speculative_config: str | dict | None = opt(
        None, 'speculative decoding (vLLM\'s flag): a JSON object {"method": "ngram", '
              '"num_speculative_tokens": K, "prompt_lookup_max": N, "prompt_lookup_min": M}: '
              'greedy requests verify up to K tokens looked up in their context in one step, '
              'with the tokens they would get without it (docs/runtime.md)')
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def capture_size_list(self) -> list[int] | None:
        """The decode batch sizes to capture (None: the default set)."""
        sizes = self.capture_sizes
        if sizes is None:
            return None
        if isinstance(sizes, str):
            try:
                sizes = [int(x) for x in sizes.split(",") if x.strip()]
            except ValueError:
                raise ValueError(f"capture_sizes {self.capture_sizes!r}: comma-separated integers") from None
        if not sizes or min(sizes) < 1:
            raise ValueError(f"capture_sizes {self.capture_sizes!r}: positive batch sizes")
        return sorted(set(sizes))

    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype, self.device)

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs) -> "EngineConfig":
        """From flat keyword arguments, as LLM(...) takes them (vLLM's style)."""
        cache = {k: kwargs.pop(k) for k in list(kwargs) if k in CacheConfig.__dataclass_fields__}
        sched = {k: kwargs.pop(k) for k in list(kwargs) if k in SchedulerConfig.__dataclass_fields__}
        par = {k: kwargs.pop(k) for k in list(kwargs) if k in ParallelConfig.__dataclass_fields__}
        unknown = set(kwargs) - set(cls.__dataclass_fields__)
        if unknown:
            raise TypeError(f"unknown engine options: {sorted(unknown)}")
        return cls(model=model, cache=CacheConfig(**cache), scheduler=SchedulerConfig(**sched),
                   parallel=ParallelConfig(**par), **kwargs)
