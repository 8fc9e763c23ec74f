"""Gemma 2 (Gemma2ForCausalLM; GGUF `gemma2`): Gemma 3's embeddings, norms of
1 + w, sandwich norms and GeGLU, without q/k norms, with every other layer
sliding (the first of each pair) under one RoPE, and logit soft-capping:
each attention score and each final logit s becomes cap * tanh(s / cap).
Parity with transformers from an HF dir (torch ops and the C ones) and from
a GGUF as llama.cpp writes it, the engine's greedy tokens past the window,
a QoQ checkpoint on the engine against its simulation."""
import dataclasses

import pytest
import torch
import transformers
from test_gemma3 import gguf_runs_as_reference, ours, randomized, saved
from test_model_parity import full_logits
from test_quant_pipeline import calib, qoq_engine_matches_simulation, tiny_source

from qoqserve.layers.token_ops import CpuTokenOps, TorchTokenOps
from qoqserve.llm import LLM
from qoqserve.model_loader import load_model_source
from qoqserve.models.arch import ModelArchConfig
from qoqserve.sampling_params import SamplingParams

WINDOW = 16
# caps that bind on these random weights (the real ones are 50 and 30)
ATTN_CAP, LOGIT_CAP = 2.0, 3.0


def tiny_gemma2(**overrides):
    return randomized(transformers.Gemma2ForCausalLM, transformers.Gemma2Config(**{
        "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "query_pre_attn_scalar": 24,
        "sliding_window": WINDOW, "max_position_embeddings": 256, "attn_logit_softcapping": ATTN_CAP,
        "final_logit_softcapping": LOGIT_CAP, "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1,
        **overrides}))


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    ref = tiny_gemma2()
    return ref, saved(ref, tmp_path_factory.mktemp("gemma2"))


def test_the_config_reads_as_transformers_does(gemma2):
    ref, path = gemma2
    arch = load_model_source(path).arch
    assert (arch.architecture, arch.mlp_act, arch.tie_word_embeddings, arch.qk_norm) == ("gemma2", "gelu_tanh",
                                                                                         True, False)
    assert (arch.attn_softcap, arch.logit_softcap) == (ATTN_CAP, LOGIT_CAP) and arch.rope_local_theta is None
    assert arch.attn_scale == 24 ** -0.5 and arch.embed_scale == 8.0 and arch.sandwich_norms and arch.norm_offset
    assert [arch.window_of(i) for i in range(4)] == [WINDOW, None, WINDOW, None]
    assert ModelArchConfig.from_hf_config(arch.to_hf_config("float32")) == arch
    # a config from before layer_types (transformers 4.4x), and one that leaves the caps out: Gemma 2's defaults
    old = {k: v for k, v in ref.config.to_dict().items()
           if k not in ("layer_types", "attn_logit_softcapping", "final_logit_softcapping")}
    again = ModelArchConfig.from_hf_config(old)
    assert again.sliding_layers == (0, 2) and (again.attn_softcap, again.logit_softcap) == (50.0, 30.0)
    assert ModelArchConfig.from_hf_config({**old, "attn_logit_softcapping": None}).attn_softcap is None


@pytest.mark.parametrize("ops", [TorchTokenOps, CpuTokenOps])
def test_logits_are_transformers_past_the_window(gemma2, ops):
    ref, path = gemma2
    src = load_model_source(path)
    model = ours(src.arch, src.iter_tensors(), ops())
    ids = torch.randint(0, 300, (4 * WINDOW,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = ref(ids[None]).logits[0]
    got = full_logits(model, ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert got.abs().max() < LOGIT_CAP
    # the caps bind here: without either the logits are others
    for field in ("attn_softcap", "logit_softcap"):
        uncapped = ours(dataclasses.replace(src.arch, **{field: None}), src.iter_tensors(), ops())
        assert (full_logits(uncapped, ids) - want).abs().max() > 1e-2, field


def test_the_engine_decodes_what_transformers_predicts(gemma2):
    ref, path = gemma2
    llm = LLM(path, dtype="float32", num_blocks=32)
    # the logits' cap is a C call the captured head records
    assert llm.engine.runner.captured is not None and llm.engine.runner.captured.with_head
    prompt = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    out = llm.generate([prompt], params)[0]  # greedy: decode bursts of captured steps, the argmax in the head
    with torch.inference_mode():
        logits = ref(torch.tensor([prompt + out.token_ids])).logits[0]
    assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == out.token_ids
    # with logprobs, the sampler's: the chosen tokens' from the capped logits too
    scored = llm.generate([prompt], dataclasses.replace(params, logprobs=True))[0]
    assert scored.token_ids == out.token_ids
    want_lp = torch.log_softmax(logits[len(prompt) - 1:-1], -1).max(-1).values
    torch.testing.assert_close(torch.tensor(scored.logprobs), want_lp, atol=1e-4, rtol=0)
    want = torch.log_softmax(logits[:len(prompt) - 1], -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(llm.engine.prompt_logprobs(prompt), want, atol=1e-4, rtol=0)


def test_a_gguf_as_llama_cpp_writes_it(tmp_path):
    from test_model_loader import _write_gguf
    ref = tiny_gemma2()
    path = tmp_path / "gemma2.gguf"
    # llama.cpp's Gemma 2 file: norms with the 1 added, the window, both caps;
    # the query scale is llama.cpp's rule (head_dim but for the 27B), so the
    # reference is rebuilt with head_dim's
    _write_gguf(path, ref, "gemma2", "gpt-2", meta=lambda w: (
        w.add_sliding_window(WINDOW), w.add_float32("gemma2.attn_logit_softcapping", ATTN_CAP),
        w.add_float32("gemma2.final_logit_softcapping", LOGIT_CAP)))
    src = load_model_source(str(path))
    arch = src.arch
    assert (arch.architecture, arch.embed_scale, arch.attn_scale) == ("gemma2", 8.0, 32 ** -0.5)
    assert (arch.attn_softcap, arch.logit_softcap, arch.sliding_layers) == (ATTN_CAP, LOGIT_CAP, (0, 2))
    # without the keys, llama.cpp's defaults: window 4096, caps 50 and 30
    bare = tmp_path / "bare.gguf"
    _write_gguf(bare, ref, "gemma2", "gpt-2")
    plain = load_model_source(str(bare)).arch
    assert (plain.sliding_window, plain.attn_softcap, plain.logit_softcap) == (4096, 50.0, 30.0)
    ids = torch.randint(0, 300, (4 * WINDOW,), generator=torch.Generator().manual_seed(2))
    gguf_runs_as_reference(path, src, ref, ids, tmp_path)


def test_a_qoq_checkpoint_runs_on_the_engine_as_its_simulation(tmp_path):
    from qoqserve.quant.config import get_preset
    from qoqserve.quant.pipeline import quantize_model
    source = tiny_source("gemma2", tmp_path)
    assert (source.arch.attn_softcap, source.arch.logit_softcap) == (4.0, 8.0)
    cfg = get_preset("g64", calib_samples=8, calib_seq_len=64, scale_tuning_epochs=1)
    result = quantize_model(source, cfg, calib(), progress=False)
    assert not result.config.rotate and result.config.smooth_in  # as Gemma 3: sandwich norms
    # keys rotated but not centred: a shift moves soft-capped scores by other amounts
    for layer in result.model.layers:
        kt = layer.self_attn.key_transform
        assert not kt.shift.any() and not torch.equal(kt.rotation, torch.eye(kt.rotation.shape[0]))
    # chunks of 32 past the window of 24, the sliding layers' KV4 pages in a pool of their own
    llm = qoq_engine_matches_simulation(result, source, calib(), tmp_path / "qoq", calib(1, 60, seed=9).samples[0],
                                        max_num_seqs=1, max_num_batched_tokens=32)
    assert llm.engine.runner.num_window_pages < llm.engine.runner.num_blocks
