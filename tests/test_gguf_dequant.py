"""GGUF's legacy block formats dequantized by torch (model_loader/gguf_dequant.py)
against the gguf package's own dequantization, to the bit."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from qoqserve.model_loader import gguf_dequant


def _blocks(fmt: str, n: int, seed: int) -> np.ndarray:
    """n random blocks of fmt, their fp16 scales and minimums finite, of both signs."""
    rng = np.random.default_rng(seed)
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[fmt]
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    halves = 2 if fmt == "Q4_1" else 1
    scales = (rng.standard_normal((n, halves)) * 0.05).astype(np.float16)
    raw[:, :2 * halves] = scales.view(np.uint8).reshape(n, 2 * halves)
    return raw


@pytest.mark.parametrize("fmt", gguf_dequant.fast_formats())
def test_fast_formats_give_the_gguf_packages_bits(fmt):
    rows, cols = 6, 96  # three blocks a row
    raw = _blocks(fmt, rows * cols // 32, seed=len(fmt)).reshape(rows, -1)
    want = np.asarray(gguf_dequantize(raw, GGMLQuantizationType[fmt]), dtype=np.float32).reshape(rows, cols)
    got = gguf_dequant.dequantize(raw, fmt, (rows, cols))
    assert got.dtype == torch.float32 and got.shape == (rows, cols)
    assert torch.equal(got, torch.from_numpy(want))


def test_bytes_that_are_not_whole_blocks_are_refused():
    with pytest.raises(ValueError, match="not whole blocks of 20"):
        gguf_dequant.dequantize(np.zeros(30, np.uint8), "Q4_1", (32,))
