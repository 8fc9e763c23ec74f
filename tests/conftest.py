"""Shared pytest fixtures.

Anything slow to build (the embedded model, transformers' view of it) is
session-scoped so every test module can reuse it.
"""
from __future__ import annotations

import contextlib
import os

# The Triton kernels run in Triton's interpreter on CPU; the flag is read when
# kernels are defined, so it must be set before any of them is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
# The suite in several processes (scripts/test.sh: pytest-xdist): each takes its
# share of the cores, read before torch starts its threads; more threads than
# cores make every OpenMP team in the C kernels wait on the others
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _WORKERS)))

import pytest  # noqa: E402


def pytest_configure(config):
    if _WORKERS > 1:  # torch may have started its threads before this file was read
        import torch
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# The slowest test files, slowest first. scripts/test.sh hands files to the
# workers in collection order (--no-loadscope-reorder; xdist's own order is by
# test count, which put files of a few long tests last, one worker running
# them alone at the end), so these start first and the workers end together.
SLOWEST_FIRST = ("test_qoq_embedded", "test_speculative", "test_chunked_prefill", "test_tensor_parallel",
                 "test_engine", "test_graphed_decode", "test_w4a8_runtime", "test_server_load",
                 "test_embedded_model", "test_model_loader", "test_server_schemathesis", "test_triton_aot",
                 "test_quality", "test_server_http_options", "test_server_api", "test_server_soak")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: a file keeps its own order


def free_port() -> int:
    """A free 127.0.0.1 port below the kernel's ephemeral range: a server binds
    it seconds after it is chosen (after loading its model), and a port from
    bind(0) can meanwhile become the local end of an outgoing connection (a
    client's, torch.distributed's), which an ephemeral-range port may be."""
    import random
    import socket

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for port in random.Random().sample(range(max(1024, low - 12000), low), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # a crowded machine: any port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_built():
    """Every C kernel built up front, on all cores (else each test that first
    calls one pays for its build, one compiler at a time)."""
    from qoqserve.kernels.cpu import prebuild

    prebuild.build_all()


@pytest.fixture(scope="session")
def default_gguf_path() -> str:
    """Path of the embedded SmolLM2-135M-Instruct Q4_1 GGUF.

    Not skipped when missing: scripts/bootstrap.sh installs it, and a suite that
    silently skipped the real-model tests would pass without testing anything.
    """
    from qoqserve.model_loader import default_gguf_path

    return default_gguf_path()


@pytest.fixture(scope="session")
def default_source(default_gguf_path):
    """Our ModelSource for the embedded GGUF."""
    from qoqserve.model_loader import load_model_source

    return load_model_source(default_gguf_path)


@pytest.fixture(scope="session")
def hf_gguf_model(default_gguf_path):
    """transformers' LlamaForCausalLM loaded (dequantized, FP32) from the embedded GGUF."""
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(default_gguf_path)
    return AutoModelForCausalLM.from_pretrained(d, gguf_file=f).eval()


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(default_gguf_path):
    """transformers' tokenizer built from the embedded GGUF's metadata."""
    from transformers import AutoTokenizer

    d, f = os.path.split(default_gguf_path)
    return AutoTokenizer.from_pretrained(d, gguf_file=f)


class ServerProcess:
    """`qoqserve serve` in a subprocess on a free 127.0.0.1 port."""

    def __init__(self, args: list[str], api_key: str | None = None, env: dict | None = None,
                 scheme: str = "http"):
        import subprocess
        import sys
        import tempfile

        self.port = free_port()
        self.api_key = api_key
        self.base = f"{scheme}://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "qoqserve.cli.main", "serve", *args, "--port", str(self.port)]
        if api_key:
            cmd += ["--api-key", api_key]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        self._wait_ready()

    def _wait_ready(self, timeout: float = 180.0) -> None:
        import time

        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.base + "/health", timeout=1.0, verify=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server did not come up in {timeout}s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def metrics(self) -> dict[str, float]:
        """Unlabelled view of /metrics: name -> value (histograms as _sum/_count)."""
        import httpx

        values = {}
        for line in httpx.get(self.base + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                key = name.split("{", 1)[0]
                values[key] = values.get(key, 0.0) + float(value)
        return values

    def stop(self, timeout: float = 60.0) -> int:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


SERVER_ARGS = ["--dtype", "float32", "--kv-cache-gb", "0.25", "--max-model-len", "512",
               "--max-prompt-tokens", "256", "--max-tokens-limit", "300",
               "--max-body-bytes", "65536"]


@pytest.fixture(scope="session")
def server(default_gguf_path):
    """One server on the embedded FP model for all server tests (it keeps an API key)."""
    proc = ServerProcess([default_gguf_path, *SERVER_ARGS], api_key="test-key")
    yield proc
    proc.stop()


@contextlib.contextmanager
def in_process_server(engine, config=None):
    """An HTTP server in this process over `engine` (so a test can reach into
    it: inject faults, slow it down): yields (base url, AsyncEngine). The engine
    is the server thread's until the block ends, then the caller's again."""
    import socket
    import threading
    import time

    import uvicorn

    from qoqserve.server.config import ServerConfig
    from qoqserve.server.launch import build_server

    app, async_engine = build_server(engine, config or ServerConfig())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}", async_engine
    finally:
        server.should_exit = True
        thread.join(30)
        async_engine.shutdown()


class PoisonedSampler:
    """Fault injection: the engine's real sampler, raising after it has drawn
    (so seeded generators moved, as in a real failure mid-sampling) whenever
    a request `is_poisoned` picks is in the call. Stands in for the next bug
    a request could trigger, now that admission refuses every known one."""

    def __init__(self, inner, is_poisoned):
        self.inner, self.is_poisoned = inner, is_poisoned
        self.failed_batch_sizes: list[int] = []

    def __call__(self, logits, requests, **kwargs):
        out = self.inner(logits, requests, **kwargs)
        for r in requests:
            if self.is_poisoned(r):
                self.failed_batch_sizes.append(len(requests))
                raise RuntimeError(f"injected fault for {r.request_id}")
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


class FlakyRunner:
    """Fault injection: the engine's real runner, failing its next `failures`
    runs whatever the batch (a fault no request can be blamed for)."""

    def __init__(self, inner, failures: int = 0):
        self.inner, self.failures = inner, failures

    def run(self, batch):
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError("injected engine fault")
        return self.inner.run(batch)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture(scope="session")
def reference_llm(default_gguf_path):
    """The offline engine the server's greedy outputs must equal."""
    from qoqserve.llm import LLM

    return LLM(default_gguf_path, dtype="float32", kv_cache_gb=0.1, max_model_len=512)


def page_layout(fmt: str, hkv: int, d: int, bs: int = 16):
    """The page layout of a format ("int4", "int8" or a dense dtype name)."""
    import torch

    from qoqserve.layers import kv_cache as kc

    if fmt == "int4":
        return kc.Int4KVCacheLayout(hkv, d, bs)
    if fmt == "int8":
        return kc.Int8KVCacheLayout(hkv, d, bs)
    return kc.DenseKVCacheLayout(hkv, d, bs, getattr(torch, fmt))


def make_pages(heads: int, hkv: int, d: int, lens: list[int], bs: int = 16,
                   num_blocks: int = 64, seed: int = 0, layout=None):
    """KV4 pages (or those of `layout`) holding random K/V for sequences of the
    given lengths, their pages scattered over the pool: (layout, cache, block
    tables, lengths)."""
    import torch

    from qoqserve.layers.kv_cache import Int4KVCacheLayout

    torch.manual_seed(seed)
    layout = layout or Int4KVCacheLayout(hkv, d, bs)
    cache = layout.allocate(num_blocks, "cpu")
    perm = torch.randperm(num_blocks).tolist()
    width = max(-(-n // bs) for n in lens)
    tables, used = [], 0
    for n in lens:
        nb = -(-n // bs)
        tables.append(perm[used:used + nb] + [0] * (width - nb))
        used += nb
    tables = torch.tensor(tables)
    for i, n in enumerate(lens):
        pos = torch.arange(n)
        slots = tables[i, pos // bs] * bs + pos % bs
        layout.write(cache, torch.randn(n, hkv, d) * 2, torch.randn(n, hkv, d), slots)
    return layout, cache, tables, torch.tensor(lens)


@pytest.fixture(scope="session")
def qoq_tiny(tmp_path_factory):
    """A QoQ W4A8KV4 g64 checkpoint of a tiny random Llama (quick config)."""
    # lazy: test helpers live in a test module
    from test_quant_pipeline import calib, tiny_source

    from qoqserve.quant.checkpoint import save_checkpoint
    from qoqserve.quant.config import get_preset
    from qoqserve.quant.pipeline import quantize_model
    tmp = tmp_path_factory.mktemp("qoq_tiny")
    source = tiny_source("llama", tmp)
    result = quantize_model(source, get_preset("g64", calib_samples=4, calib_seq_len=64), calib(4),
                            progress=False)
    save_checkpoint(result, source, calib(4), str(tmp / "ckpt"))
    return str(tmp / "ckpt")


def _cpu_flags() -> set[str]:
    try:
        return set(open("/proc/cpuinfo").read().split())
    except OSError:
        return set()


def cpu_has_avx512() -> bool:
    return {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= _cpu_flags()


def cpu_has_avx2() -> bool:
    return {"avx2", "fma", "f16c"} <= _cpu_flags()


@pytest.fixture(params=["avx512", "avx2", "scalar"])
def isa(request, monkeypatch):
    """Every path of the C attention kernels the CPU has, each checked to be
    the one taken (QOQSERVE_CPU_ISA=avx2 runs the AVX2 path on AVX-512 CPUs)."""
    from qoqserve.kernels.cpu import paged_decode, paged_prefill

    if request.param == "avx512":
        monkeypatch.delenv("QOQSERVE_CPU_ISA", raising=False)
        if not cpu_has_avx512():
            pytest.skip("no AVX-512 here")
    else:
        monkeypatch.setenv("QOQSERVE_CPU_ISA", request.param)
        if request.param == "avx2" and not cpu_has_avx2():
            pytest.skip("no AVX2 here")
    for kernel in (paged_decode, paged_prefill):
        if kernel.isa() != request.param:
            pytest.fail(f"{kernel.__name__}: path {request.param} not taken (got {kernel.isa()})")
    return request.param
