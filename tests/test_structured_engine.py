"""Structured outputs in the engine (the embedded model, fp32, offline):
constrained and free requests in one batch, preemption and recompute, a
failing step, the captured decode step, the grammar cache, bad specs."""
from __future__ import annotations

import json

import pytest
from conftest import PoisonedSampler

from qoqserve.errors import InvalidRequestError
from qoqserve.sampling_params import SamplingParams, StructuredOutputs

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}}, "required": ["name", "age"]}
PERSON = "A person as JSON:"
FREE = ["The capital of France is", "Water boils at"]


def constrained(seed=None, **kw) -> SamplingParams:
    return SamplingParams(temperature=0 if seed is None else 0.8, seed=seed, max_tokens=30,
                          structured_outputs=StructuredOutputs(json=SCHEMA, disable_any_whitespace=True),
                          **kw)


def free_params() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def check_person(text: str) -> None:
    obj = json.loads(text)
    assert set(obj) == {"name", "age"} and isinstance(obj["age"], int) and len(obj["name"]) <= 12


def run(engine, requests: dict[str, tuple], on_step=None) -> dict[str, object]:
    """Add every (prompt, params) request, then step to the end: one shared batch."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outs, step = {}, 0
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
        step += 1
        if on_step is not None:
            on_step(step)
    return outs


@pytest.fixture(scope="module")
def engine(reference_llm):
    return reference_llm.engine


@pytest.fixture(scope="module")
def alone(engine):
    """The free requests without the constrained ones and the other way round:
    what each must give in any batch."""
    free = run(engine, {"free0": (FREE[0], free_params()), "free1": (FREE[1], free_params())})
    held = run(engine, {"greedy": (PERSON, constrained()), "seeded": (PERSON, constrained(seed=3))})
    return {rid: o.text for rid, o in {**free, **held}.items()}


def test_constrained_outputs_match_the_schema_and_the_decode_step_ran_captured(engine, alone):
    assert engine.runner.captured is not None and engine.runner.captured.disabled is None
    check_person(alone["greedy"])
    check_person(alone["seeded"])


def test_a_mixed_batch_changes_no_request_and_a_stop_string_cuts_a_constrained_one(engine, alone):
    reqs = {"free0": (FREE[0], free_params()), "greedy": (PERSON, constrained()),
            "free1": (FREE[1], free_params()), "seeded": (PERSON, constrained(seed=3)),
            "stopped": (PERSON, constrained(stop=[","]))}
    outs = run(engine, reqs)
    stopped = outs.pop("stopped")
    assert {rid: o.text for rid, o in outs.items()} == alone
    assert stopped.text == alone["greedy"][:alone["greedy"].index(",")] and stopped.finish_reason == "stop"


def test_a_preempted_constrained_request_recomputes_to_the_same_output(engine, alone):
    def preempt(step):
        if step == 4:  # mid-generation: its pages go, its matcher stays
            seq = next(s for s in engine.scheduler.running if s.request_id == "greedy")
            engine.scheduler.running.remove(seq)
            engine.scheduler._preempt(seq)

    n = engine.scheduler.num_preemptions
    outs = run(engine, {"greedy": (PERSON, constrained()), "free0": (FREE[0], free_params())}, preempt)
    assert engine.scheduler.num_preemptions == n + 1
    assert outs["greedy"].text == alone["greedy"] and outs["free0"].text == alone["free0"]


def test_a_step_failing_on_one_constrained_request_ends_only_it(engine, alone):
    runner = engine.runner
    real = runner.sampler
    runner.sampler = PoisonedSampler(real, lambda r: r.request_id == "bad" and r.num_output_tokens >= 3)
    try:
        outs = run(engine, {"bad": (PERSON, constrained()), "greedy": (PERSON, constrained()),
                            "free0": (FREE[0], free_params())})
    finally:
        runner.sampler = real
    assert outs["bad"].finish_reason == "error"
    assert outs["greedy"].text == alone["greedy"] and outs["free0"].text == alone["free0"]


def test_the_grammar_of_a_spec_is_compiled_once(engine):
    spec = {"type": "object", "properties": {"cache_probe": {"type": "boolean"}}}
    misses = engine.grammars.misses
    for _ in range(3):
        engine.prepare_request(PERSON, SamplingParams(structured_outputs=StructuredOutputs(json=spec)))
    assert engine.grammars.misses == misses + 1


@pytest.mark.parametrize("spec, code", [
    (dict(json={"type": "object", "properties": {"a": {"type": "strin"}}}), "unsupported_schema"),
    (dict(regex="(ab"), "invalid_grammar"),
    (dict(grammar="root ::= ("), "invalid_grammar"),
    (dict(structural_tag={"type": "structural_tag", "format": {"type": "nope"}}), "invalid_grammar"),
])
def test_a_bad_spec_is_refused_at_admission_with_its_reason(engine, spec, code):
    with pytest.raises(InvalidRequestError) as e:
        engine.prepare_request(PERSON, SamplingParams(structured_outputs=StructuredOutputs(**spec)))
    assert e.value.code == code and e.value.param.startswith("structured_outputs.")
    assert "[" not in str(e.value)[:3], str(e.value)  # xgrammar's source location is cut


def test_choice_and_ignore_eos_end_when_the_grammar_does(engine):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                            structured_outputs=StructuredOutputs(choice=['say "yes"', "no\\way"]))
    out = run(engine, {"c": ("Answer:", params)})["c"]
    assert out.text in ('say "yes"', "no\\way") and out.finish_reason == "stop"



def matches(compiler, spec: StructuredOutputs, text: str) -> bool:
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiler.compile(spec)).accept_string(text)


def test_json_whitespace_is_bounded_per_gap_and_json_object_is_an_object(engine):
    from qoqserve.engine.structured import GrammarCompiler

    tok, vocab, stops = engine.tokenizer, engine.arch.vocab_size, sorted(engine.eos_ids)
    bounded, free = GrammarCompiler(tok, vocab, stops, max_whitespace=3), GrammarCompiler(tok, vocab, stops)
    assert engine.grammars.max_whitespace == 8  # the engine's default
    schema = StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    assert matches(bounded, schema, '{"a":\n  1}') and not matches(bounded, schema, '{"a":    1}')
    assert matches(free, schema, '{"a":' + " " * 30 + "1}")
    obj = StructuredOutputs(json_object=True)
    assert matches(bounded, obj, '{"x": [1, {"y": null}]}') and not matches(bounded, obj, '{"x":\n\n\n\n1}')
    assert not matches(bounded, obj, "[1]") and not matches(free, obj, "[1]")  # OpenAI's json_object
    compact = StructuredOutputs(json=schema.json, disable_any_whitespace=True)
    assert not matches(free, compact, '{"a":  1}')
    with pytest.raises(ValueError, match="max_whitespace"):
        GrammarCompiler(tok, vocab, stops, max_whitespace=-1)
