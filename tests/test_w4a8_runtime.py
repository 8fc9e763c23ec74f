"""The W4A8KV4 runtime on QoQ checkpoints: INT8 GEMMs vs the simulation per
layer, weight/KV memory, KV4 pages vs the fake-quant pass."""
import pytest
import torch
from test_quant_pipeline import _full, calib, tiny_source

from qoqserve.config import CacheConfig, EngineConfig
from qoqserve.engine.model_runner import ModelRunner
from qoqserve.layers.kv_cache import DenseKVCacheLayout, Int4KVCacheLayout
from qoqserve.layers.linear import Linear
from qoqserve.llm import LLM
from qoqserve.model_loader import load_model_source
from qoqserve.quant.checkpoint import save_checkpoint
from qoqserve.quant.config import get_preset
from qoqserve.quant.pipeline import quantize_model
from qoqserve.sampling_params import SamplingParams


@pytest.fixture(scope="module", params=["g64", "chn"])
def ckpt(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("w4a8")
    source = tiny_source("llama", tmp)
    cfg = get_preset(request.param, calib_samples=8, calib_seq_len=64)
    result = quantize_model(source, cfg, calib(), progress=False)
    out = tmp / f"ckpt-{request.param}"
    save_checkpoint(result, source, calib(), str(out))
    return str(out)


def runner(path, backend, **cache):
    src = load_model_source(path)
    cfg = EngineConfig(model=path, dtype="float32", w4a8_backend=backend,
                       cache=CacheConfig(num_blocks=cache.pop("num_blocks", 16), **cache))
    return ModelRunner(cfg, src.arch, src.iter_tensors(), 512, src.quant_config)


def test_every_layer_int8_matches_simulation(ckpt):
    sim, int8, percall, packed = (runner(ckpt, b).model for b in
                                  ("sim", "torch-int8", "torch-int8-percall", "packed"))
    torch.manual_seed(0)
    linears = [(n, m) for n, m in sim.named_modules() if isinstance(m, Linear)]
    assert len(linears) == 8
    for name, lin in linears:
        x = torch.randn(7, lin.in_features) * 3
        x[:, 5] *= 20  # an outlier channel, as real activations have
        ref = lin(x)
        got = int8.get_submodule(name)(x)
        # INT32 accumulation vs fp32 sums of the same integers: equal up to fp32 rounding
        torch.testing.assert_close(got, ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-5)
        assert torch.equal(percall.get_submodule(name)(x), got)
        assert torch.equal(packed.get_submodule(name)(x), got)  # 4-bit in registers, same integers


def test_load_log_and_stats_report_paths_and_bytes(ckpt):
    for backend, max_bytes in (("packed", 0.56), ("torch-int8-percall", 0.6), ("torch-int8", 1.1)):
        r = runner(ckpt, backend)
        s = r.stats()
        params = sum(m.in_features * m.out_features for m in r.model.modules() if isinstance(m, Linear))
        per_param = s["linear_weight_bytes"] / params
        assert per_param <= max_bytes, (backend, per_param)
        assert any(backend in p for p in s["linear_paths"])
        assert s["kv_layout"] == "int4"


def test_kv4_costs_under_0_3x_fp16_and_pool_grows_accordingly():
    # codes D/2 bytes + fp16 scale and zero per head: 0.28x at D=64, 0.27x at D=128
    # (0.31x at D=32, where the 4 metadata bytes weigh more)
    for hkv, d in ((3, 64), (8, 128), (2, 32)):
        int4 = Int4KVCacheLayout(hkv, d, 16).bytes_per_token()
        fp16 = DenseKVCacheLayout(hkv, d, 16, torch.float16).bytes_per_token()
        assert int4 == 2 * hkv * (d // 2 + 4)
        assert int4 / fp16 <= (0.3 if d >= 64 else 0.32)
    pools = {}
    for kv in ("float16", "int4"):
        llm = LLM(dtype="float32", kv_cache_gb=0.05, kv_cache_dtype=kv)
        pools[kv] = llm.engine.runner.num_blocks
        del llm
    assert pools["int4"] / pools["float16"] >= 1 / 0.3 - 0.01


def test_kv4_paged_decode_matches_fake_quant_full_pass(ckpt):
    """Greedy decode reading INT4 pages == teacher-forced pass over fake-quantized K/V."""
    # quantized_prefill: the prompt's own hidden states also see stored K/V, as in the full pass
    llm = LLM(ckpt, dtype="float32", num_blocks=16, block_size=16, w4a8_backend="sim",
              quantized_prefill=True)
    prompt = calib(1, 40, seed=9).samples[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    logits = _full(llm.engine.runner.model, prompt + out.token_ids)
    teacher = logits[len(prompt) - 1:-1].argmax(-1).tolist()
    assert teacher == out.token_ids


def _random_pages(layout, num_blocks, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = layout.allocate(num_blocks, torch.device("cpu"))
    n = num_blocks * layout.block_size
    kv = torch.randn(n, layout.num_kv_heads, layout.head_dim, generator=g) * 2
    layout.write(cache, kv, kv.flip(0) * 0.5, torch.arange(n))
    return cache


@pytest.mark.parametrize("layout", [Int4KVCacheLayout(2, 64, 16),
                                    DenseKVCacheLayout(2, 64, 16, torch.float32)])
def test_decode_attention_math_matches_sdpa_path(layout):
    """The compile-friendly decode math == the SDPA path, ragged lengths, shuffled pages."""
    from qoqserve.layers.attention import AttentionMetadata, PagedAttention
    from qoqserve.layers.attention_backends import AttentionBackend, decode_attention

    cache = _random_pages(layout, 24)
    tables = torch.randperm(24).view(3, 8)
    lens = torch.tensor([1, 77, 128])
    q = torch.randn(3, 6, 64)
    attn = PagedAttention(6, 2, 64, AttentionBackend(layout))
    meta = AttentionMetadata(False, None, tables, lens)
    ref = attn._decode(q, meta, cache)
    got = decode_attention(layout, cache, tables, lens, q, attn.scale, 6)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_compiled_decode_attention_matches_eager_in_one_graph_for_every_batch():
    from torch._dynamo.utils import counters

    from qoqserve.layers.attention_backends import AttentionBackend, decode_attention

    layout = Int4KVCacheLayout(2, 64, 16)
    cache = _random_pages(layout, 24, seed=1)
    backend = AttentionBackend(layout, compiled=True)
    graphs = counters["stats"]["unique_graphs"]
    # batches equal to the K/V pair, to the pages per sequence, to the heads:
    # none may be compiled as that size (one graph for all of them)
    for b, n in ((2, 8), (3, 3), (5, 4), (6, 2)):
        tables = torch.randperm(24)[:b * n].view(b, n)
        lens = torch.randint(1, n * 16 + 1, (b,))
        q = torch.randn(b, 6, 64)
        ref = decode_attention(layout, cache, tables, lens, q, 0.125, 6)
        torch.testing.assert_close(backend.decode(q, cache, tables, lens, 0.125), ref, atol=1e-4, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] - graphs == 1


def test_mixed_weight_and_kv_formats(ckpt):
    """W4A8 with full-precision KV, and full-precision weights with KV4, both run."""
    prompt = calib(1, 24, seed=3).samples[0]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    w4_fp_kv = LLM(ckpt, dtype="float32", num_blocks=16, kv_cache_dtype="float32")
    assert w4_fp_kv.engine.stats()["kv_layout"] == "float32"
    assert len(w4_fp_kv.generate([prompt], greedy)[0].token_ids) == 8
    fp_kv4 = LLM(dtype="float32", kv_cache_gb=0.02, kv_cache_dtype="int4")
    s = fp_kv4.engine.stats()
    assert s["kv_layout"] == "int4" and s["linear_paths"] == ["c-dense"]  # fp32 on the C dense kernel
    out = fp_kv4.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_tokens=12))[0]
    assert "Paris" in out.text


def test_kv8_pages_round_trip_within_half_a_step_and_cost_about_half_of_fp16():
    from qoqserve.layers.kv_cache import Int8KVCacheLayout

    layout = Int8KVCacheLayout(2, 64, 16)
    assert layout.bytes_per_token() == 2 * 2 * (64 + 2)
    assert layout.bytes_per_token() / DenseKVCacheLayout(2, 64, 16, torch.float16).bytes_per_token() < 0.52
    torch.manual_seed(0)
    k, v = torch.randn(20, 2, 64) * 3, torch.randn(20, 2, 64)
    k[3, 1] = 0  # an all-zero head
    cache = layout.allocate(4, "cpu")
    slots = torch.randperm(64)[:20]
    layout.write(cache, k, v, slots)
    tables = torch.arange(4)[None]
    rk, rv = layout.read(cache, tables, torch.float32)
    for x, r in ((k, rk[0, slots]), (v, rv[0, slots])):
        step = (x.abs().amax(-1, keepdim=True) / 127).half().float()
        assert ((x - r).abs() <= step * 0.5 * (1 + 1e-3) + 1e-7).all()
        assert torch.equal(r, layout.fake_quant(x))


def test_fp_model_runs_with_kv8_pages_close_to_fp():
    prompt = "The capital of France is"
    params = SamplingParams(temperature=0, max_tokens=8)
    fp = LLM(dtype="float32", kv_cache_gb=0.05).generate(prompt, params)[0]
    kv8 = LLM(dtype="float32", kv_cache_gb=0.05, kv_cache_dtype="int8")
    assert kv8.engine.stats()["kv_layout"] == "int8"
    out = kv8.generate(prompt, params)[0]
    assert out.token_ids[:4] == fp.token_ids[:4]
