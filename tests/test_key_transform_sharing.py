"""Layers whose key-transform R are equal share one tensor at run time, and
only at run time: the quantizer fills each layer's R in place."""
import torch
from torch import nn

from qoqserve.layers.key_transform import KeyTransform, share_equal_rotations
from qoqserve.llm import LLM
from qoqserve.quant.config import get_preset
from qoqserve.quant.pipeline import build_fp_model


def _layers(rotations):
    model = nn.ModuleList()
    for r in rotations:
        kt = KeyTransform(2, r.shape[0], r.dtype)
        kt.rotation.data = r.clone()
        model.append(kt)
    return model


def test_equal_rotations_become_one_tensor_and_unequal_ones_stay_apart():
    g = torch.Generator().manual_seed(0)
    a = torch.linalg.qr(torch.randn(8, 8, generator=g))[0]
    b = torch.linalg.qr(torch.randn(8, 8, generator=g))[0]
    model = _layers([a, b, a, b, a, a.to(torch.bfloat16)])
    assert share_equal_rotations(model) == 3  # a, b, and a in another dtype
    ptr = [kt.rotation.data_ptr() for kt in model]
    assert ptr[0] == ptr[2] == ptr[4] and ptr[1] == ptr[3]
    assert len({ptr[0], ptr[1], ptr[5]}) == 3
    for kt, want in zip(model, [a, b, a, b, a]):
        assert torch.equal(kt.rotation, want)


def test_the_engine_shares_the_checkpoints_equal_rotations(qoq_tiny):
    model = LLM(qoq_tiny, kv_cache_gb=0.05).engine.runner.model
    rotations = [layer.self_attn.key_transform.rotation for layer in model.layers]
    assert len(rotations) > 1 and len({r.data_ptr() for r in rotations}) == 1
    assert not torch.equal(rotations[0], torch.eye(rotations[0].shape[0]))  # the checkpoint's R, not the identity


def test_the_quantizers_model_keeps_one_rotation_a_layer(tmp_path):
    from test_quant_pipeline import tiny_source  # a test helper of another module

    model = build_fp_model(tiny_source("llama", tmp_path), get_preset("g64"), "cpu", max_positions=64)
    rotations = [layer.self_attn.key_transform.rotation for layer in model.layers]
    # all the identity after loading, yet each its own: the pipeline fills them one by one
    assert all(torch.equal(r, rotations[0]) for r in rotations)
    assert len({r.data_ptr() for r in rotations}) == len(rotations) > 1
