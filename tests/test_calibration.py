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
