"""The learned residual rotation (quant/transforms/learned_rotation.py) on a
tiny random Llama: orthogonal, exact when folded without quantization,
better than its Hadamard start on the loss it trains, and carried by the
config through the CLI and the checkpoint."""
import argparse
import dataclasses
import json

import pytest
import torch
from test_quant_pipeline import calib, tiny_source
from test_quant_transforms import assert_same, logits

from qoqserve.cli.quantize import add_quant_args, quant_config_from_args
from qoqserve.quant.checkpoint import save_checkpoint
from qoqserve.quant.config import get_preset, with_rotation
from qoqserve.quant.pipeline import build_fp_model, quantize_model
from qoqserve.quant.transforms.learned_rotation import RotationTrainer, cayley, training_windows
from qoqserve.quant.transforms.rotation import fold_norms, rotate_model

CFG = get_preset("g64", rotation="learned", rotation_steps=6, rotation_lr=5e-3, rotation_samples=4,
                 rotation_seq_len=32, rotation_batch=2, calib_samples=4, calib_seq_len=64)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return tiny_source("llama", tmp_path_factory.mktemp("lrot"))


@pytest.fixture(scope="module")
def trained(source):
    """(trainer, learned rotation) after CFG's steps on a norm-folded model."""
    model = build_fp_model(source, CFG, "cpu")
    with torch.no_grad():
        fold_norms(model)
    trainer = RotationTrainer(model, training_windows(calib(4).samples, CFG), CFG)
    return trainer, trainer.train()


def test_cayley_is_orthogonal_for_any_generator():
    b = torch.randn(48, 48, dtype=torch.float64)
    c = cayley(b)
    assert torch.allclose(c.T @ c, torch.eye(48, dtype=torch.float64), atol=1e-10)
    assert torch.equal(cayley(torch.zeros(8, 8, dtype=torch.float64)), torch.eye(8, dtype=torch.float64))


def test_learned_rotation_is_orthogonal_and_moved(trained):
    trainer, result = trained
    r = result.r
    eye = torch.eye(r.shape[0], dtype=torch.float64)
    assert (r.T @ r - eye).abs().max() < 1e-5
    assert (r - trainer.q0).abs().max() > 1e-3  # it trained: R is not the start


def test_training_lowers_the_fake_quant_loss(trained):
    # the loss the steps trained, on the same windows, at the start and at R: every
    # window (not the last batch), with weights, activations (and nothing else) fake-quantized
    trainer, result = trained
    start, end = trainer.evaluate(trainer.q0), trainer.evaluate(result.r)
    assert len(result.curve) == CFG.rotation_steps
    assert end < start * 0.98, (start, end)


def test_folded_learned_rotation_keeps_fp_logits(source, trained):
    # fp32 model with exact KV (KV4 would turn fp32 rounding differences in K
    # and V into whole 4-bit steps, on some machines and not on others),
    # rotation folded in float64 and rounded once. Relative to the largest
    # logit: the Hadamard start and the learned R fold to ~3e-6-3e-5 on this
    # model and text; a wrong fold moves logits by > 1e-2
    _, result = trained
    exact_kv = dataclasses.replace(CFG, kv_bits=16)
    ids = torch.tensor(calib(1, 48).samples[0])
    ref = logits(build_fp_model(source, exact_kv, "cpu").eval(), ids)
    model = build_fp_model(source, exact_kv, "cpu")
    rotate_model(model, q=result.r)
    assert_same(ref, logits(model, ids), tol=1e-4)


def test_rotation_option_through_cli_and_checkpoint(source, tmp_path):
    p = argparse.ArgumentParser()
    add_quant_args(p)
    args = p.parse_args(["--rotation", "learned", "--rotation-steps", "2", "--rotation-lr", "0.01",
                         "--rotation-samples", "2", "--rotation-seq-len", "16", "--rotation-loss", "ce",
                         "--no-rotation-act-quant", "--rotation-lr-decay", "--calib-samples", "2",
                         "--calib-seq-len", "32"])
    cfg = quant_config_from_args(args)
    assert (cfg.rotation, cfg.rotation_steps, cfg.rotation_lr, cfg.rotation_samples, cfg.rotation_seq_len,
            cfg.rotation_loss, cfg.rotation_act_quant, cfg.rotation_lr_decay) == \
        ("learned", 2, 0.01, 2, 16, "ce", False, True)
    assert quant_config_from_args(p.parse_args([])).rotation == "hadamard"
    result = quantize_model(source, cfg, calib(2, 32), progress=False)
    assert "rotate-learned" in result.steps and len(result.rotation_curve) == 2
    save_checkpoint(result, source, calib(2, 32), str(tmp_path))
    stored = json.loads((tmp_path / "quant_config.json").read_text())["config"]
    assert stored["rotation"] == "learned" and stored["rotation_loss"] == "ce"
    with pytest.raises(SystemExit):
        p.parse_args(["--rotation", "spin"])
    with pytest.raises(ValueError, match="rotation"):
        get_preset("g64", rotation="spin")


def test_with_rotation_switches_only_rotating_configs():
    g64, rtn = get_preset("g64"), get_preset("rtn-w4a8kv4-g64")
    out = with_rotation([g64, rtn], "learned")
    assert out[0].rotation == "learned" and out[0].name != g64.name and out[1] == rtn
    assert with_rotation([g64], None) == [g64]
