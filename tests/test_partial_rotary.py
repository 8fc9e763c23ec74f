"""Partial rotary embeddings (Phi-4-mini: RoPE on the first 0.75 of each
head's channels, the rest unturned), with LongRoPE over them: parity with
transformers, the C qkv_rope against the torch ops, SmoothAttention's pairs,
a GGUF with rope.dimension_count below head_dim, the engine on the C kernels
and a QoQ checkpoint against its simulation."""
import numpy as np
import torch
from test_longrope import HEAD_DIM, LONG_CTX, ORIG, _ours, matches_transformers_with_either_set, tiny_phi3_longrope
from test_model_loader import _write_gguf
from test_model_parity import full_logits
from test_quant_pipeline import _any_tokenizer, qoq_engine_matches_simulation

from qoqserve.layers.key_transform import KeyTransform
from qoqserve.layers.rotary import RotaryEmbedding
from qoqserve.layers.token_ops import CpuTokenOps, TorchTokenOps
from qoqserve.llm import LLM
from qoqserve.model_loader import load_model_source
from qoqserve.models.arch import ModelArchConfig
from qoqserve.quant.calibration import CalibrationSet
from qoqserve.quant.config import get_preset
from qoqserve.quant.pipeline import quantize_model
from qoqserve.quant.transforms.smooth import pair_max, smooth_attention
from qoqserve.sampling_params import SamplingParams

ROT = HEAD_DIM // 2  # partial_rotary_factor 0.5


def test_logits_are_transformers_with_either_longrope_set():
    ref = tiny_phi3_longrope(partial=0.5)
    arch = ModelArchConfig.from_hf_config(ref.config.to_dict())
    assert arch.rotary_dim == ROT and len(arch.rope_scaling["long_factor"]) == ROT // 2
    assert ModelArchConfig.from_hf_config(arch.to_hf_config("float32")).rotary_dim == ROT
    matches_transformers_with_either_set(ref)
    # turning every channel instead fails
    model, _ = _ours(ref, LONG_CTX)
    for layer in model.layers:
        layer.self_attn.rope = RotaryEmbedding(HEAD_DIM, LONG_CTX, arch.rope_theta)
    ids = torch.randint(0, 300, (50,))
    with torch.inference_mode():
        assert (full_logits(model, ids) - ref(ids[None]).logits[0]).abs().max() > 1e-2


def test_the_c_qkv_rope_turns_only_the_rotary_channels():
    g = torch.Generator().manual_seed(3)
    ref, c = TorchTokenOps(), CpuTokenOps()
    rope = RotaryEmbedding(HEAD_DIM, 512, 1e4, rotary_dim=ROT)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        kt = KeyTransform(2, HEAD_DIM, dtype)
        kt.shift.data = torch.randn(2, HEAD_DIM, generator=g).to(dtype)
        kt.rotation.data = torch.linalg.qr(torch.randn(HEAD_DIM, HEAD_DIM, generator=g))[0].to(dtype).contiguous()
        qkv = torch.randn(9, 8 * HEAD_DIM, generator=g).to(dtype)
        pos = torch.randint(0, 500, (9,), generator=g)
        for transform in (None, kt):
            for a, b in zip(c.qkv_rope(qkv, pos, rope, transform, 4, 2, HEAD_DIM),
                            ref.qkv_rope(qkv, pos, rope, transform, 4, 2, HEAD_DIM)):
                assert (a.float() - b.float()).abs().max() <= tol * max(1.0, b.float().abs().max().item())
        q = c.qkv_rope(qkv, pos, rope, None, 4, 2, HEAD_DIM)[0]
        assert torch.equal(q[..., ROT:].flatten(1), qkv[:, :4 * HEAD_DIM].view(9, 4, HEAD_DIM)[..., ROT:].flatten(1))
        assert not torch.equal(q[..., :ROT], qkv[:, :4 * HEAD_DIM].view(9, 4, HEAD_DIM)[..., :ROT])


def test_smooth_attention_pairs_only_the_turned_channels():
    assert pair_max(torch.tensor([[1.0, 5.0, 3.0, 2.0, 7.0, 0.5]]), 4).tolist() == [[3.0, 5.0, 3.0, 5.0, 7.0, 0.5]]
    ref = tiny_phi3_longrope(partial=0.5)
    ids = torch.randint(0, 300, (60,))
    model, _ = _ours(ref, LONG_CTX)
    before = full_logits(model, ids)
    g = torch.Generator().manual_seed(4)
    for layer in model.layers:  # any key scales: with RoPE's pairs, q.k is unchanged
        smooth_attention(layer, torch.rand(2, HEAD_DIM, generator=g) * 10 + 0.1, 0.5, rotary=ROT)
    torch.testing.assert_close(full_logits(model, ids), before, atol=1e-4, rtol=1e-4)
    for layer in model.layers:  # paired over all channels instead: RoPE no longer commutes
        smooth_attention(layer, torch.rand(2, HEAD_DIM, generator=g) * 10 + 0.1, 0.5)
    assert (full_logits(model, ids) - before).abs().max() > 1e-3


def test_a_gguf_whose_rope_dimension_count_is_below_head_dim(tmp_path):
    ref = tiny_phi3_longrope(partial=0.5)
    scaling = ModelArchConfig.from_hf_config(ref.config.to_dict()).rope_scaling
    path = tmp_path / "phi4-mini.gguf"
    _write_gguf(path, ref, "phi3", "gpt-2", extra={
        "rope_factors_long.weight": np.array(scaling["long_factor"], dtype=np.float32),
        "rope_factors_short.weight": np.array(scaling["short_factor"], dtype=np.float32)},
        meta=lambda w: (w.add_rope_dimension_count(ROT), w.add_rope_scaling_orig_ctx_len(ORIG),
                        w.add_rope_scaling_attn_factors(scaling["attention_factor"])))
    src = load_model_source(str(path))
    assert src.arch.rotary_dim == ROT
    model, _ = _ours(ref, LONG_CTX)
    model.load_weights(src.iter_tensors())
    ids = torch.randint(0, 300, (100,))
    with torch.inference_mode():
        torch.testing.assert_close(full_logits(model, ids), ref(ids[None]).logits[0], atol=1e-4, rtol=1e-4)


def test_the_engine_and_a_qoq_checkpoint(tmp_path, monkeypatch):
    ref = tiny_phi3_longrope(partial=0.5)
    ref.save_pretrained(tmp_path / "hf")
    _any_tokenizer().save(str(tmp_path / "hf"))
    prompt = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    llm = LLM(str(tmp_path / "hf"), dtype="float32", num_blocks=32)
    assert llm.engine.runner.captured is not None  # decode steps replay the C qkv_rope
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].token_ids
    with torch.inference_mode():
        assert ref(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1].argmax(-1).tolist() == out
    source = load_model_source(str(tmp_path / "hf"))
    cfg = get_preset("g64", calib_samples=8, calib_seq_len=64, scale_tuning_epochs=0, smooth_attention=True,
                     smooth_attention_alpha=0.5)  # SmoothAttention surely applied, over RoPE's pairs
    from qoqserve.quant import pipeline
    pairs = []  # the pipeline smooths over RoPE's pairs of this model (test above: others break it)

    def spy(*args, **kwargs):
        pairs.append(args[6] if len(args) > 6 else kwargs.get("rotary"))
        return smooth_attention(*args, **kwargs)
    monkeypatch.setattr(pipeline, "smooth_attention", spy)
    data = CalibrationSet(torch.randint(3, 300, (8, 64), generator=torch.Generator().manual_seed(6)).tolist(),
                          "0" * 64, "random")
    result = quantize_model(source, cfg, data, progress=False)
    assert pairs == [ROT, ROT]
    qoq_engine_matches_simulation(result, source, data, tmp_path / "qoq", prompt)
