"""Qwen3: the Llama block with an RMSNorm over each q and k head before RoPE
(and a head_dim of its own). The FP engine on the C kernels against
transformers, a QoQ checkpoint through the engine against its simulation,
and what the quantizer refuses."""
import pytest
import torch
from test_quant_pipeline import calib, qoq_engine_matches_simulation, tiny_source

from qoqserve.llm import LLM
from qoqserve.quant.config import get_preset
from qoqserve.quant.pipeline import quantize_model
from qoqserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """(the HF dir's ModelSource, transformers' model of it)."""
    import transformers

    source = tiny_source("qwen3", tmp_path_factory.mktemp("qwen3"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32).eval()
    return source, ref


def _greedy(llm, prompt, n=16):
    return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].token_ids


def test_the_engine_on_the_c_kernels_decodes_what_transformers_predicts(qwen3):
    source, ref = qwen3
    assert source.arch.qk_norm and source.arch.head_dim == 64
    llm = LLM(source.path, dtype="float32", num_blocks=32, enable_prefix_caching=False)
    assert llm.engine.runner.captured is not None  # decode steps replay the C calls, qkv_rope's norms too
    prompt = calib(1, 24, seed=3).samples[0]
    out = _greedy(llm, prompt)
    with torch.inference_mode():
        logits = ref(torch.tensor([prompt + out])).logits[0]
    assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == out
    # the scored pass too: every prompt position's logprob within fp32 rounding of transformers'
    want = torch.log_softmax(logits[:len(prompt) - 1], -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(llm.engine.prompt_logprobs(prompt), want, atol=1e-4, rtol=0)


def test_a_qoq_checkpoint_runs_on_the_engine_as_its_simulation(qwen3, tmp_path):
    source, _ = qwen3
    cfg = get_preset("g64", calib_samples=8, calib_seq_len=64, scale_tuning_epochs=0)
    result = quantize_model(source, cfg, calib(), progress=False)
    prompt = calib(1, 40, seed=9).samples[0]
    # the C path: qkv_rope with the norms and the key transform
    qoq_engine_matches_simulation(result, source, calib(), tmp_path, prompt, 16)
    exact = LLM(str(tmp_path), dtype="float32", num_blocks=32, quantized_prefill=True, lm_head_dtype="float",
                kernels="torch", w4a8_backend="sim")
    torch.testing.assert_close(exact.engine.prompt_logprobs(prompt), result.model.prompt_logprobs(prompt),
                               atol=2e-2, rtol=0)  # fp16 storage


def test_smooth_attention_is_refused_where_qk_norms_would_undo_it(qwen3):
    source, _ = qwen3
    cfg = get_preset("g64", calib_samples=2, calib_seq_len=32, smooth_attention=True)
    with pytest.raises(ValueError, match="SmoothAttention.*q/k norms"):
        quantize_model(source, cfg, calib(2, 32), progress=False)
