"""The shipped calibration set: usable offline, never overlapping evaluation text."""
import os

from qoqserve.eval.perplexity import LICENSE_TEXTS, read_texts
from qoqserve.quant.calibration import DEFAULT_CALIB_FILE, load_calibration

NGRAM = 12


def _ngrams(ids, n):
    return {tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)}


def test_default_calibration_set_is_shipped_and_large_enough(default_source):
    assert os.path.isfile(DEFAULT_CALIB_FILE)
    calib = load_calibration(default_source.tokenizer, None, 64, 512)
    assert len(calib.samples) == 64 and all(len(s) == 512 for s in calib.samples)
    assert len({tuple(s[:16]) for s in calib.samples}) == 64  # distinct windows
    assert len(calib.sha256) == 64


def test_calibration_never_overlaps_the_evaluation_texts(default_source):
    tok = default_source.tokenizer
    with open(DEFAULT_CALIB_FILE, encoding="utf-8") as f:
        calib = tok.encode(f.read(), add_special_tokens=False)
    evals = tok.encode(read_texts(LICENSE_TEXTS), add_special_tokens=False)
    shared = _ngrams(calib, NGRAM) & _ngrams(evals, NGRAM)
    assert not shared, [tok.decode(list(s)) for s in list(shared)[:3]]


def test_overlap_check_can_fail(default_source):
    tok = default_source.tokenizer
    evals = tok.encode(read_texts(LICENSE_TEXTS[1:]), add_special_tokens=False)
    leaked = tok.encode("Some calibration text. ", add_special_tokens=False) + evals[1000:1100]
    assert _ngrams(leaked, NGRAM) & _ngrams(evals, NGRAM)


def test_user_calibration_file(default_source, tmp_path):
    p = tmp_path / "calib.txt"
    p.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    calib = load_calibration(default_source.tokenizer, str(p), 4, 128)
    assert len(calib.samples) == 4 and calib.source == str(p)


def test_long_windows_are_spread_over_the_text_with_short_ones_between(default_source):
    tok = default_source.tokenizer
    with open(DEFAULT_CALIB_FILE, encoding="utf-8") as f:
        ids = tok.encode(f.read(), add_special_tokens=False)
    calib = load_calibration(tok, None, 128, 512, long_samples=9, long_seq_len=2048)
    lengths = [len(s) for s in calib.samples]
    span = len(ids) // 9
    per_span = (span - 2048) // 512
    assert lengths == ([2048] + [512] * per_span) * 9
    assert calib.describe() == f"9 x 2048 + {9 * per_span} x 512 tokens"
    # each span opens with its long window, the short ones follow it in the text
    assert calib.samples[0] == ids[:2048] and calib.samples[1] == ids[2048:2560]
    assert calib.samples[per_span + 1] == ids[span:span + 2048]
    # num_samples caps the short windows
    capped = load_calibration(tok, None, 5, 512, long_samples=9, long_seq_len=2048)
    assert sorted(map(len, capped.samples)).count(512) == 5 and len(capped.samples) == 14


def test_long_windows_the_text_cannot_hold_are_refused(default_source, tmp_path):
    import pytest
    p = tmp_path / "calib.txt"
    p.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    with pytest.raises(ValueError, match="fewer than 8 calibration windows of 2048"):
        load_calibration(default_source.tokenizer, str(p), 4, 128, long_samples=8, long_seq_len=2048)
