"""The quality metrics (qoqserve eval quality) on models whose answer is known:
a model against itself, against a copy with noise on its weights, and the
embedded FP model on the shortest pass-key task. Task data never overlaps
the calibration text."""
import pytest
import torch
from test_calibration import NGRAM, _ngrams

from qoqserve.eval import agreement, format_following, kl, retrieval
from qoqserve.eval.filler import filler_text
from qoqserve.eval.generate import greedy_generate
from qoqserve.eval.perplexity import perplexity
from qoqserve.eval.subject import engine_subject, model_subject
from qoqserve.llm import LLM
from qoqserve.model_loader.synthetic import load_synthetic
from qoqserve.quant.calibration import DEFAULT_CALIB_FILE
from qoqserve.quant.config import get_preset
from qoqserve.quant.pipeline import build_fp_model

EOS = [2]


def _noisy(model, scale: float, seed: int = 0):
    """A copy of the model with Gaussian noise (scale x each weight's std) on every matrix."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.add_(torch.randn(p.shape, generator=g) * p.std() * scale)
    return model


@pytest.fixture(scope="module")
def tiny():
    """A tiny random Llama as FP, a second FP copy, and two noisy copies (KV4 off)."""
    source = load_synthetic("synthetic:tiny")
    cfg = get_preset("rtn-kv4", kv_bits=16)
    return {name: _noisy(build_fp_model(source, cfg, "cpu"), scale)
            for name, scale in (("fp", 0.0), ("copy", 0.0), ("noisy", 0.05), ("noisier", 0.3))}


@pytest.fixture(scope="module")
def text_ids():
    return torch.randint(3, 512, (700,), generator=torch.Generator().manual_seed(3)).tolist()


def test_kl_of_identical_models_is_zero_and_noise_makes_it_worse(tiny, text_ids):
    ref = tiny["fp"].prompt_logits
    same = kl.compare(ref, tiny["copy"].prompt_logits, text_ids, 256, 256)
    assert same.kl_mean == pytest.approx(0.0, abs=1e-6) and same.kl_p99 == pytest.approx(0.0, abs=1e-6)
    assert same.same_top == 1.0 and same.ppl == pytest.approx(same.ref_ppl, rel=1e-6)
    noisy = kl.compare(ref, tiny["noisy"].prompt_logits, text_ids, 256, 256)
    noisier = kl.compare(ref, tiny["noisier"].prompt_logits, text_ids, 256, 256)
    assert 0 < noisy.kl_mean < noisier.kl_mean and noisy.kl_p99 < noisier.kl_p99
    assert noisier.same_top < noisy.same_top <= 1.0 and noisier.same_top < 0.95
    assert noisy.kl_median <= noisy.kl_p99 <= noisy.kl_max
    # the perplexities come from the windows and numbers of eval/perplexity.py
    assert noisy.ref_ppl == pytest.approx(perplexity(tiny["fp"].prompt_logprobs, text_ids, 256, 256).ppl,
                                          rel=1e-5)
    assert noisy.num_tokens == len(text_ids) - 3  # one unscored token per disjoint window


def test_kl_matches_a_direct_computation():
    g = torch.Generator().manual_seed(0)
    p, q = torch.randn(5, 11, generator=g), torch.randn(5, 11, generator=g)
    want = (p.softmax(-1) * (p.log_softmax(-1) - q.log_softmax(-1))).sum(-1)
    assert torch.allclose(kl.token_kl(p, q), want, atol=1e-6)


def test_greedy_generate_equals_recomputing_the_whole_prefix(tiny):
    """The cached batched decode loop gives the tokens a full recompute picks."""
    model = tiny["noisy"]
    prompts = [[5, 17, 99, 3, 250], [7, 8, 9], list(range(40, 70))]
    outs = greedy_generate(model, prompts, 8, EOS)
    for prompt, out in zip(prompts, outs):
        ids = list(prompt)
        for _ in range(len(out)):
            ids.append(int(model.prompt_logits(ids, [len(ids) - 1]).argmax()))
        assert out == ids[len(prompt):]


def test_greedy_agreement_is_one_for_itself_and_equals_real_decoding(tiny):
    prompts = [[11 + i, 200 - i, 37, 5 * i + 3] for i in range(6)]
    k = 10
    refs = greedy_generate(tiny["fp"], prompts, k, EOS)
    same = agreement.greedy_agreement(tiny["copy"].prompt_logits, prompts, refs, k)
    assert same.rate == 1.0 and same.mean_prefix == 1.0
    for name in ("noisy", "noisier"):
        # teacher-forced agreement == what the tested model's own greedy decoding shares with FP
        own = greedy_generate(tiny[name], prompts, k, EOS)
        res = agreement.greedy_agreement(tiny[name].prompt_logits, prompts, refs, k)
        shared = []
        for o, r in zip(own, refs):
            n = 0
            while n < min(len(o), len(r)) and o[n] == r[n]:
                n += 1
            shared.append(n / len(r))
        assert res.mean_prefix == pytest.approx(sum(shared) / len(shared))
    assert res.rate < 1.0  # the noisier copy diverges somewhere


def test_json_replies_are_scored_by_parsing():
    tasks = (("x", ("a", "b")),) * 5
    replies = ['{"a": 1, "b": [2]}', 'Sure!\n```json\n{"b": "x", "a": null}\n```', '{"a": 1}',
               '{"a": 1, "b": 2', "no json here {"]
    res = format_following.score_replies(replies, tasks)
    assert res.rate == pytest.approx(2 / 5) and res.parsed == pytest.approx(3 / 5)
    assert format_following.first_json_object('x {bad} {"k": {"n": 1}}') == {"k": {"n": 1}}


def test_task_text_never_overlaps_the_calibration_text(default_source):
    tok = default_source.tokenizer
    with open(DEFAULT_CALIB_FILE, encoding="utf-8") as f:
        calib = _ngrams(tok.encode(f.read(), add_special_tokens=False), NGRAM)
    texts = [filler_text(tok, 8192, seed) for seed in range(3)]
    texts += [tok.decode(c.ids) for c in retrieval.build_cases(tok, (512,), (0.5,), 2)]
    texts += [tok.decode(c.ids) for c in retrieval.build_free_cases(tok, (512,), (0.5,), 2)]
    texts += [tok.decode(p) for p in agreement.chat_prompt_ids(tok)]
    texts += [tok.decode(p) for p in format_following.prompt_ids(tok)]
    for text in texts:
        shared = _ngrams(tok.encode(text, add_special_tokens=False), NGRAM) & calib
        assert not shared, [tok.decode(list(s)) for s in list(shared)[:3]]


def test_pass_key_cases_hit_their_length_and_hide_the_key(default_source):
    tok = default_source.tokenizer
    cases = retrieval.build_cases(tok, (1024, 2048), (0.1, 0.9), 1)
    for c in cases:
        assert c.length - 32 <= len(c.ids) <= c.length
        text = tok.decode(c.ids[:c.key_rows[0] + 1])
        assert text.count(c.key) == 2 and text.endswith(retrieval.REPLY_PREFIX)
        assert [tok.decode([t]) for t in c.key_ids] == list(c.key)
    shallow, deep = tok.decode(cases[0].ids), tok.decode(cases[1].ids)
    assert shallow.index(cases[0].key) < len(shallow) * 0.3 < len(deep) * 0.7 < deep.index(cases[1].key)


def test_fp_embedded_model_finds_the_pass_key_at_the_shortest_length(default_source):
    """Otherwise the task measures nothing (chance would pick all 5 digits 1e-5 of the time)."""
    fp = model_subject("FP32", build_fp_model(default_source, get_preset("rtn-kv4", kv_bits=16), "cpu"),
                       default_source.arch.eos_token_ids)
    cases = retrieval.build_cases(default_source.tokenizer, (retrieval.DEFAULT_LENGTHS[0],), (0.2, 0.8), 1)
    hits = [retrieval.found(fp.logits, c) for c in cases]
    print(f"FP pass-key accuracy at {cases[0].length} tokens: {sum(hits)}/{len(hits)}")
    assert all(hits)


def test_free_pass_key_cases_hit_their_length_and_state_the_key_once(default_source):
    tok = default_source.tokenizer
    cases = retrieval.build_free_cases(tok, (1024, 2048), (0.1, 0.9), 1)
    assert [(c.length, c.depth) for c in cases] == [(1024, 0.1), (1024, 0.9), (2048, 0.1), (2048, 0.9)]
    forced = {c.key for c in retrieval.build_cases(tok, (1024, 2048), (0.1, 0.9), 1)}
    assert not forced & {c.key for c in cases}  # its own draw of keys
    for c in cases:
        assert c.length - 32 <= len(c.ids) <= c.length
        text = tok.decode(c.ids)
        assert text.count(c.key) == 1 and text.endswith(f"{retrieval.FREE_QUESTION}\nassistant\n")
        turn = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
        assert c.ids[-len(turn):] == turn  # the model writes the whole reply
        assert retrieval.FREE_QUESTION in text and retrieval.REPLY_PREFIX + c.key in text
    shallow, deep = tok.decode(cases[0].ids), tok.decode(cases[1].ids)
    assert shallow.index(cases[0].key) < len(shallow) * 0.3 < len(deep) * 0.7 < deep.index(cases[1].key)


def test_free_replies_are_scored_by_the_key_as_a_number_of_its_own():
    finds = retrieval.free_reply_finds
    assert finds("The pass key is 48213.", "48213") and finds("48213", "48213")
    assert finds("It is: 48213, I think", "48213")
    assert not finds("The pass key is 482131.", "48213") and not finds("148213", "48213")
    assert not finds("The pass key is 4821.", "48213") and not finds("a small wooden key", "48213")


def test_free_pass_key_accuracy_counts_per_length_over_batches():
    """A stub model that answers with the key only for odd cases at the
    shorter length: the score is per length, whatever the batching."""
    class Tok:
        def decode(self, ids, skip_special_tokens=False):
            return "".join(map(chr, ids))
    cases = [retrieval.FreePasskeyCase(n, 0.5, str(10000 + i), [n, i]) for n in (1024, 2048) for i in range(5)]
    calls = []

    def generate(prompts, max_new):
        calls.append(len(prompts))
        return [[ord(c) for c in (f"The pass key is {10000 + i}." if n == 1024 and i % 2 else "No idea.")]
                for n, i in prompts]
    acc, replies = retrieval.free_passkey_accuracy(generate, Tok(), cases, batch=4)
    assert acc == {1024: pytest.approx(2 / 5), 2048: 0.0} and calls == [4, 4, 2]
    assert replies[1] == "The pass key is 10001." and replies[0] == "No idea."


def test_fp_embedded_model_finds_the_free_pass_key_at_the_shortest_length(default_source):
    """The free protocol is harder (the model writes its whole reply); FP must
    still solve it at the shortest length, or the column measures nothing."""
    tok = default_source.tokenizer
    fp = model_subject("FP32", build_fp_model(default_source, get_preset("rtn-kv4", kv_bits=16), "cpu"),
                       default_source.arch.eos_token_ids)
    cases = retrieval.build_free_cases(tok, (retrieval.DEFAULT_LENGTHS[0],), (0.2, 0.8), 1)
    acc, replies = retrieval.free_passkey_accuracy(fp.generate, tok, cases)
    print(f"FP free pass-key accuracy at {cases[0].length} tokens: {acc}; replies {replies}")
    assert acc == {cases[0].length: 1.0}


def test_engine_subject_scores_as_it_decodes(qoq_tiny):
    """The runtime engine (INT8 GEMMs, KV4 pages): its logits give its own
    perplexity numbers, and teacher-forced agreement with its own greedy
    decoding is 1 (the equivalence the agreement metric rests on)."""
    llm = LLM(qoq_tiny, quantized_prefill=True, num_blocks=64, enforce_eager=True)
    subject = engine_subject("engine", llm)
    ids = torch.randint(3, 512, (90,), generator=torch.Generator().manual_seed(5)).tolist()
    lp = torch.log_softmax(subject.logits(ids, None), -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(lp.cpu(), llm.engine.prompt_logprobs(ids), atol=1e-4, rtol=0)
    prompts = [[11 + i, 200 - i, 37, 5 * i + 3] for i in range(4)]
    refs = subject.generate(prompts, 8)
    assert all(len(r) == 8 for r in refs)
    res = agreement.greedy_agreement(subject.logits, prompts, refs, 8)
    assert res.rate == 1.0


def test_table_renders_the_same_after_a_json_round_trip():
    import json

    from qoqserve.eval.quality_table import to_markdown
    row = dict(ppl=21.0, ppl_delta=0.0, kl_mean=0.0, kl_p99=0.0, same_top=1.0, greedy_agreement=1.0, greedy_prefix=1.0,
               passkey={1024: 0.9, 2048: 0.5}, passkey_free={1024: 0.85, 2048: 0.25}, json_rate=0.75)
    table = {"options": {"lengths": [1024, 2048]},
             "rows": [dict(row, config="FP32"),
                      dict(row, config="g64", ppl=25.2, ppl_delta=0.2, kl_mean=0.19, quantize_seconds=264.0)]}
    md = to_markdown(table)
    assert md == to_markdown(json.loads(json.dumps(table)))
    assert "| g64 | 25.200 | +20.0% | 0.1900 |" in md and "| 90% | 50% | 85% | 25% | 75% | 264 |" in md
    assert "| pass key 1k | pass key 2k | free pass key 1k | free pass key 2k | JSON keys |" in md
    # a row kept from before the free task existed shows no number for it
    old = {k: v for k, v in table["rows"][1].items() if k != "passkey_free"}
    assert "| 90% | 50% | — | — | 75% | 264 |" in to_markdown({**table, "rows": [old]})


def _row(config, **kw):
    row = dict(config=config, ppl=21.0, ppl_delta=0.0, kl_mean=0.0, kl_p99=0.0, same_top=1.0,
               greedy_agreement=1.0, greedy_prefix=1.0, passkey={1024: 1.0}, passkey_free={1024: 1.0},
               json_rate=0.5)
    return {**row, **kw}


def test_accuracy_doc_blocks_are_regenerated_in_place_and_prose_kept(tmp_path):
    from qoqserve.eval.accuracy import LABELS, write_doc
    doc = tmp_path / "accuracy.md"
    doc.write_text("intro\n\n<!-- eval accuracy: main -->\nold table\n<!-- end eval accuracy -->\n\nprose\n")
    table = {"options": {"lengths": [1024]}, "rows": [
        _row("FP32"), _row("g64", ppl=25.2, ppl_delta=0.2, commit="abc1234", measured_utc="2026-12-02 03:00",
                           load_average=[0.4, 0.5, 0.6]),
        {"config": "g128", "not_applicable": "group size 128 does not divide the model's hidden size 576"}]}
    write_doc(str(doc), table, {"main": ["FP32", "g128", "g64", "engine qoq"]})
    text = doc.read_text()
    assert text.startswith("intro\n\n<!-- eval accuracy: main -->\nMeasured 2026-12-02 UTC")
    assert text.endswith("<!-- end eval accuracy -->\n\nprose\n") and "old table" not in text
    assert "commit abc1234" in text and "load average 0.4-0.4" in text
    lines = [line for line in text.splitlines() if line.startswith("| ")][2:]
    assert [line.split(" | ")[0] for line in lines] == ["| FP32", f"| {LABELS['g128']}", f"| {LABELS['g64']}"]
    assert "not applicable: group size 128 does not divide" in lines[1]
    assert lines[1].count("|") == lines[0].count("|")  # as many cells as the other rows
    with pytest.raises(ValueError, match="ablation"):
        write_doc(str(doc), table, {"ablation": ["FP32"]})


def test_a_resumed_table_keeps_only_rows_measured_the_same_way():
    import json
    from dataclasses import asdict

    from qoqserve.eval.quality import QualityOptions, _reusable
    settings = json.loads(json.dumps(get_preset("g64").to_dict()))
    table = {"model": "m", "options": asdict(QualityOptions()), "rows": []}
    earlier = json.loads(json.dumps({**table, "rows": [_row("FP32"), _row("g64", quant_config=settings)]}))
    assert list(_reusable(earlier, table)) == ["g64"]  # FP is the reference: always measured
    older = {**earlier, "options": {k: v for k, v in earlier["options"].items() if k != "tasks"}}
    assert list(_reusable(older, table)) == ["g64"]  # written before --tasks: it measured them all
    assert _reusable({**earlier, "model": "other"}, table) == {}
    assert _reusable({**earlier, "options": {**earlier["options"], "window": 256}}, table) == {}
    assert _reusable({**earlier, "options": {**earlier["options"], "tasks": ["json"]}}, table) == {}
    assert _reusable(None, table) == {}
    # a row quantized before a QuantConfig field existed ran with its default: it matches
    # the config at that default, not one that sets the field
    # (the g64 preset's short tuning came later: its old rows are not today's g64)
    untuned = json.loads(json.dumps(get_preset("g64", scale_tuning_epochs=0, scale_tuning_windows=0).to_dict()))
    before = {k: v for k, v in untuned.items() if k not in ("scale_tuning_epochs", "scale_tuning_windows")}
    kept = _reusable({**earlier, "rows": [_row("g64", quant_config=before)]}, table)["g64"]
    assert kept["quant_config"] == untuned
    assert kept["quant_config"] != settings


def test_a_group_size_that_does_not_tile_the_model_fails_before_any_work():
    from types import SimpleNamespace

    from qoqserve.quant.pipeline import quantize_model
    arch = SimpleNamespace(hidden_size=576, intermediate_size=1536, num_heads=9, head_dim=64)
    with pytest.raises(ValueError, match=r"group size 128 does not divide the model's hidden size 576, "
                                         r"heads x head_dim 576; group sizes that fit: 32, 64"):
        get_preset("g128").check_model(arch)
    for ok in ("g64", "chn", "rtn-kv4", "rtn-w8a8"):
        get_preset(ok).check_model(arch)
    with pytest.raises(ValueError, match="group size 256"):  # raised before the model is built
        quantize_model(SimpleNamespace(arch=arch), get_preset("g64", group_size=256), calib=None)


def test_a_table_shows_only_the_tasks_it_measured():
    from qoqserve.eval.quality_table import to_markdown
    row = {k: v for k, v in _row("g64", kl_mean=0.25).items()
           if k not in ("greedy_agreement", "greedy_prefix", "passkey", "passkey_free", "json_rate")}
    md = to_markdown({"options": {"lengths": [1024], "tasks": []}, "rows": [row]})
    head, _, line = md.splitlines()
    assert head == "| configuration | PPL | vs FP | KL mean | KL p99 | same top | quantize s |"
    assert line == "| g64 | 21.000 | +0.0% | 0.2500 | 0.000 | 100.0% | — |"


def test_eval_accuracy_render_rewrites_the_doc_from_its_json_alone(tmp_path):
    import argparse
    import json

    from qoqserve.eval import accuracy
    doc, table = tmp_path / "a.md", tmp_path / "a.json"
    doc.write_text("<!-- eval accuracy: main -->\n<!-- end eval accuracy -->\n"
                   "<!-- eval accuracy: ablation -->\n<!-- end eval accuracy -->\n")
    table.write_text(json.dumps({"model": "m", "options": {"lengths": [1024]},
                                 "rows": [_row("FP32"), _row("g64", ppl=25.2, ppl_delta=0.2)]}))
    p = argparse.ArgumentParser()
    accuracy.register_args(p)
    assert accuracy.run_cmd(p.parse_args(["--render", "--doc", str(doc), "--json", str(table)])) == 0
    main, ablation = doc.read_text().split("<!-- eval accuracy: ablation -->")
    assert "| FP32 |" in main and f"| {accuracy.LABELS['g64']} | 25.200 |" in main
    assert "| FP32 |" not in ablation and f"| {accuracy.LABELS['g64']} | 25.200 |" in ablation
    with pytest.raises(SystemExit, match="--render needs"):
        accuracy.run_cmd(p.parse_args(["--render", "--json", str(tmp_path / "none.json")]))


def test_seeds_make_one_row_per_config_and_seed():
    from qoqserve.quant.config import with_seeds
    configs = [get_preset("g64"), get_preset("rtn-w8a8")]
    assert with_seeds(configs, []) == configs
    rows = with_seeds(configs, [0, 2])
    assert [(c.name, c.seed) for c in rows] == [("g64 seed 0", 0), ("g64 seed 2", 2),
                                               ("rtn-w8a8 seed 0", 0), ("rtn-w8a8 seed 2", 2)]
    assert rows[1].to_dict() == {**get_preset("g64").to_dict(), "name": "g64 seed 2", "seed": 2}
