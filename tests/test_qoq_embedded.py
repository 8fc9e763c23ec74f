"""The embedded model as a QoQ W4A8KV4 checkpoint through the real runtime."""
import json
import shutil
from pathlib import Path

import pytest
from test_engine import GREEDY, batch_prompts
from test_speculative import seeded_drawn_penalized_and_logprob_requests_keep_their_tokens

from qoqserve.eval.perplexity import LICENSE_TEXTS, perplexity, read_texts
from qoqserve.llm import LLM
from qoqserve.paths import cache_dir
from qoqserve.quant.calibration import load_calibration
from qoqserve.quant.checkpoint import save_checkpoint
from qoqserve.quant.config import get_preset
from qoqserve.quant.pipeline import quantize_model


@pytest.fixture(scope="module")
def quantized(default_source, tmp_path_factory):
    # a quick config (no GPTQ, no tuning, small calibration): the runtime is under test, not accuracy
    cfg = get_preset("g64", calib_samples=8, calib_seq_len=256, gptq=False, scale_tuning_epochs=0)
    calib = load_calibration(default_source.tokenizer, None, cfg.calib_samples, cfg.calib_seq_len)
    result = quantize_model(default_source, cfg, calib, progress=False)
    out = tmp_path_factory.mktemp("smol") / "qoq-g64"
    save_checkpoint(result, default_source, calib, str(out))
    return result, str(out)


def test_runtime_perplexity_equals_simulation(quantized, default_source):
    result, path = quantized
    long_ids = default_source.tokenizer.encode(read_texts(LICENSE_TEXTS))[:4096]
    windows = {}

    def simulation(window_ids):  # each window once: the 1k windows are the 4k run's first two
        key = tuple(window_ids)
        if key not in windows:
            windows[key] = result.model.prompt_logprobs(window_ids)
        return windows[key]

    sim_long = perplexity(simulation, long_ids, 512, 512)
    ids = long_ids[:1024]
    sim = perplexity(simulation, ids, 512, 512)
    assert len(windows) == 8
    # the float LM head: the simulation's (auto picks INT8 for QoQ, tests/test_lm_head.py)
    llm = LLM(path, dtype="float32", kv_cache_gb=0.05, quantized_prefill=True, lm_head_dtype="float")
    paths = llm.engine.stats()["linear_paths"]  # the packed 4-bit C kernel, on this CPU's best path
    assert any(p in paths for p in ("w4a8-g64/packed+vnni", "w4a8-g64/packed+amx", "w4a8-g64/packed+avx2")), paths
    runtime = perplexity(llm.engine.prompt_logprobs, long_ids, 512, 512)
    # the runtime's torch path (INT8 GEMMs on the INT8 expansion, fp64 attention
    # over fake-quantized K/V as the simulation's) is the simulation, to the bit
    exact = LLM(path, dtype="float32", kv_cache_gb=0.05, quantized_prefill=True, lm_head_dtype="float",
                kernels="torch")
    assert perplexity(exact.engine.prompt_logprobs, ids, 512, 512).ppl == sim.ppl
    # the C path sums in other orders (norms, LM head) and its prefill attention
    # is fp32 where the simulation's is fp64; per-token INT8 and KV4 rounding
    # turn those 1e-7 differences into whole steps. On 1k tokens this quick
    # checkpoint's C ppl sat anywhere from +0.2% to +5.4% of the simulation's
    # when every RMSNorm weight moved by at most one ulp (five runs); on these
    # 4k tokens the same runs stay within -1.1% and -0.4% (docs/runtime.md),
    # so 4k tokens are compared
    assert abs(runtime.ppl / sim_long.ppl - 1) < 0.02, (runtime.ppl, sim_long.ppl)
    fp = LLM(dtype="float32", kv_cache_gb=0.05)
    fp_ppl = perplexity(fp.engine.prompt_logprobs, ids, 512, 512).ppl
    assert 1.0 < sim.ppl / fp_ppl < 3.0  # a quick RTN-ish config: worse, but the same model


def test_quantized_engine_is_batch_invariant(quantized):
    _, path = quantized
    llm = LLM(path, dtype="float32", kv_cache_gb=0.1)
    prompts = batch_prompts()
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    batched = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert batched == alone
    stats = llm.engine.stats()
    assert stats["kv_layout"] == "int4" and stats["num_free_blocks"] == stats["num_kv_blocks"]


def test_drafted_requests_in_w4a8kv4_get_their_plain_tokens(quantized):
    """Speculative decoding on the W4A8KV4 embedded model (tests/test_speculative.py's case)."""
    seeded_drawn_penalized_and_logprob_requests_keep_their_tokens(quantized[1])


def _stamp_as_current(ckpt_dir):
    """The quick checkpoint passes the cache check as if made with the g64 preset."""
    quant_path = ckpt_dir / "quant_config.json"
    quant = json.loads(quant_path.read_text())
    quant["config"] = get_preset("g64").to_dict()
    quant_path.write_text(json.dumps(quant))


def test_stale_cached_checkpoint_is_not_reused(quantized, tmp_path):
    from qoqserve.quant.default_checkpoint import _is_current

    _, path = quantized
    cached = tmp_path / "ckpt"
    shutil.copytree(path, cached)
    assert not _is_current(str(cached), "g64")  # quick config != the g64 preset
    _stamp_as_current(cached)
    assert _is_current(str(cached), "g64")
    quant = json.loads((cached / "quant_config.json").read_text())
    # written before an option existed: current while the option's value is the
    # one that reproduces it, stale once it is not
    del quant["config"]["true_sequential"]
    (cached / "quant_config.json").write_text(json.dumps(quant))
    assert _is_current(str(cached), "g64")
    quant["config"]["true_sequential"] = True
    (cached / "quant_config.json").write_text(json.dumps(quant))
    assert not _is_current(str(cached), "g64")
    quant["config"]["true_sequential"] = False
    (cached / "quant_config.json").write_text(json.dumps(quant))
    assert _is_current(str(cached), "g64")
    quant["quantizer_revision"] -= 1  # same settings, a quantizer that made other numbers
    (cached / "quant_config.json").write_text(json.dumps(quant))
    assert not _is_current(str(cached), "g64")
    del quant["quantizer_revision"]  # written before revisions were recorded
    (cached / "quant_config.json").write_text(json.dumps(quant))
    assert not _is_current(str(cached), "g64")
    quant["version"] = 1  # what an older qoqserve wrote
    (cached / "quant_config.json").write_text(json.dumps(quant))
    assert not _is_current(str(cached), "g64")
    assert not _is_current(str(tmp_path / "absent"), "g64")


def test_plain_qoqserve_serve_runs_the_cached_qoq_checkpoint(quantized, tmp_path):
    """`qoqserve serve` with no model serves the embedded model's QoQ g64 checkpoint
    from the cache (here: the quick one, placed where the first use would put it)."""
    from conftest import ServerProcess
    from openai import OpenAI

    from qoqserve.sampling_params import SamplingParams

    _, path = quantized
    cached = tmp_path / "SmolLM2-135M-Instruct-qoq-g64"
    shutil.copytree(path, cached)
    _stamp_as_current(cached)
    # the cache also holds the built C kernels: reuse them (a rebuild of all of
    # them is half a minute on a slow 2-core machine and tests nothing here)
    kernels = Path(cache_dir(), "kernels")
    if kernels.is_dir():
        (tmp_path / "kernels").symlink_to(kernels, target_is_directory=True)
    srv = ServerProcess(["--max-model-len", "512", "--kv-cache-gb", "0.05"],
                        env={"QOQSERVE_CACHE": str(tmp_path)})
    try:
        client = OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        assert model == "SmolLM2-135M-Instruct-qoq-g64"
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        got = client.chat.completions.create(model=model, messages=msgs, max_tokens=16, temperature=0)
        ref = LLM(path, dtype="float32", kv_cache_gb=0.05).chat(
            msgs, SamplingParams(temperature=0, max_tokens=16))[0]
        assert got.choices[0].message.content == ref.text
        assert "int4" in srv.output()  # the KV4 pages the checkpoint asks for
    finally:
        assert srv.stop() == 0
