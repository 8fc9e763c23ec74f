import pytest
import torch

from qoqserve.engine.sequence import Sequence
from qoqserve.layers.sampler import Sampler, apply_penalties
from qoqserve.sampling_params import InvalidSamplingParams, SamplingParams


def reqs(params):
    return [Sequence(f"r{i}", [1, 2, 3], p) for i, p in enumerate(params)]


def test_greedy_is_argmax_and_logprob_is_log_softmax():
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0, logprobs=True)] * 3
    toks, lps, top = Sampler()(logits, reqs(params))
    assert toks == logits.argmax(-1).tolist()
    ref = torch.log_softmax(logits, -1)
    assert lps == pytest.approx([float(ref[i, t]) for i, t in enumerate(toks)])
    assert top is None


def test_top_logprobs_are_the_most_likely_tokens_per_row():
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0, logprobs=True, top_logprobs=k) for k in (0, 1, 5)]
    toks, lps, top = Sampler()(logits, reqs(params))
    ref = torch.log_softmax(logits, -1)
    assert [len(t) for t in top] == [0, 1, 5]
    for i, row in enumerate(top):
        order = ref[i].argsort(descending=True)[:len(row)].tolist()
        assert [t for t, _ in row] == order
        assert [lp for _, lp in row] == pytest.approx(ref[i, order].tolist())
    assert top[2][0][0] == toks[2]  # greedy picks the most likely token


def test_seeded_sampling_is_reproducible_and_batch_independent():
    torch.manual_seed(0)
    logits = torch.randn(4, 100)
    p = SamplingParams(temperature=1.0, seed=123)
    alone = Sampler(seed=0)(logits[2:3], [Sequence("a", [1], p)])[0]
    free = SamplingParams(temperature=1.0)
    batch = Sampler(seed=0)(logits, reqs([free, free, p, free]))[0]
    assert batch[2] == alone[0]


def test_a_seeded_request_keeps_its_generator_until_released():
    logits = torch.zeros(1, 1000)  # uniform: every draw moves the generator
    s, req = Sampler(), Sequence("s", [1], SamplingParams(temperature=1.0, seed=7))
    first = [s(logits, [req])[0][0] for _ in range(3)]
    s.release("s")
    again = [s(logits, [req])[0][0] for _ in range(3)]
    assert first == again and len(set(first)) > 1  # the same stream, restarted by release


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([0.7, 0.2, 0.1]))
    counts = torch.zeros(3)
    s = Sampler()
    req = reqs([SamplingParams(temperature=1.0, seed=0)])
    for _ in range(2000):
        counts[s(logits[None], req)[0][0]] += 1
    assert torch.allclose(counts / 2000, torch.tensor([0.7, 0.2, 0.1]), atol=0.04)


def test_penalties():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    p = SamplingParams(repetition_penalty=2.0)
    out = apply_penalties(logits, p, [0, 1], {})
    assert out.tolist() == [1.0, -4.0, 1.0, 0.5]
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, p, [], {2: 2})
    assert out.tolist() == [2.0, -2.0, 1.0 - 0.5 - 0.5, 0.5]


def test_logit_bias_is_added_to_its_tokens_after_the_penalties():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    p = SamplingParams(presence_penalty=0.5, logit_bias={2: 3.0, 3: -100})
    assert apply_penalties(logits, p, [], {2: 1}).tolist() == [2.0, -2.0, 1.0 - 0.5 + 3.0, 0.5 - 100]
    assert SamplingParams(logit_bias={}).logit_bias is None and not SamplingParams(logit_bias={}).has_penalties


def test_a_biased_row_moves_only_itself_and_logprobs_stay_the_models():
    logits = torch.randn(3, 50)
    banned = int(logits[1].argmax())
    params = [SamplingParams(temperature=0, logprobs=True),
              SamplingParams(temperature=0, logprobs=True, logit_bias={banned: -100}),
              SamplingParams(temperature=0, logprobs=True, logit_bias={7: 100})]
    toks, lps, _ = Sampler()(logits.clone(), reqs(params))
    second = int(logits[1].topk(2).indices[1])
    assert toks == [int(logits[0].argmax()), second, 7]
    ref = torch.log_softmax(logits, -1)
    assert lps == pytest.approx([float(ref[i, t]) for i, t in enumerate(toks)])


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(min_p=-0.1), dict(min_p=1.5), dict(top_k=-5),
    dict(max_tokens=0),
    dict(max_tokens=1.5), dict(stop=[""]), dict(seed="x"), dict(repetition_penalty=0),
    dict(presence_penalty=3), dict(min_tokens=5, max_tokens=2), dict(top_k=True), dict(seed=2**70),
    dict(top_logprobs=21, logprobs=True), dict(top_logprobs=2), dict(logit_bias={3: 101}),
    dict(logit_bias={-1: 1}), dict(logit_bias={"3": 1}), dict(logit_bias={3: float("nan")}),
    dict(logit_bias=[(3, 1)]),
])
def test_invalid_params_are_rejected_with_a_message(kwargs):
    with pytest.raises(InvalidSamplingParams) as e:
        SamplingParams(**kwargs)
    assert any(k in str(e.value) for k in kwargs)


def test_rollback_undoes_the_draws_of_a_failed_step():
    logits = torch.zeros(2, 1000)  # uniform: every draw moves the generator
    reqs_ = [Sequence("old", [1], SamplingParams(temperature=1.0, seed=3)),
             Sequence("new", [1], SamplingParams(temperature=1.0, seed=4))]
    s = Sampler()
    s.begin()
    s(logits[:1], reqs_[:1])            # "old" has a generator from an earlier step
    s.begin()
    failed = s(logits, reqs_)[0]       # the step that will fail
    s.rollback()
    s.begin()
    assert s(logits, reqs_)[0] == failed  # drawn again from the same states
    s.begin()
    assert s(logits, reqs_)[0] != failed  # and without rollback they move on


@pytest.mark.parametrize("params", [
    SamplingParams(repetition_penalty=5e-324),                  # found by schemathesis: a 500
    SamplingParams(temperature=1e-300),                         # rounds to 0 as a float32
    SamplingParams(temperature=1e-300, repetition_penalty=5e-324, top_p=0.5, seed=1),
])
def test_tiny_temperatures_and_penalties_sample_the_top_token(params):
    """They overflow the logits to inf (softmax: nan); the limit is the top token."""
    logits = torch.tensor([[2.0, -2.0, 3.0, 0.5]])
    seq = Sequence("t", [2, 1], params)
    assert Sampler()(logits, [seq])[0] == [2]


def test_the_cpu_argmax_is_torchs_index_on_ties_nans_infs_and_tails():
    from qoqserve.kernels.cpu import elementwise
    g = torch.Generator().manual_seed(0)
    for v in (1, 5, 16, 17, 49152):
        x = torch.randn(6, v, generator=g)
        x[1] = x[1].round()  # many ties: the first maximum
        x[2, :] = -float("inf")
        if v > 3:
            x[3, 2] = x[3, v - 1] = float("nan")  # the first NaN
            x[4, 1] = x[4, v - 2] = float("inf")
            x[5, 0], x[5, 3] = -0.0, 0.0
            x[5, 1:] = -1.0
        x[5, -1] = x[5].max() if v > 4 else x[5, -1]
        assert torch.equal(elementwise.argmax(x), x.argmax(dim=-1)), v
        assert torch.equal(elementwise.argmax(x[::2]), x[::2].argmax(dim=-1))  # rows a stride apart
    with pytest.raises(ValueError):
        elementwise.argmax(torch.zeros(2, 3, dtype=torch.bfloat16))


def test_penalized_rows_sample_as_apply_penalties_then_the_draw():
    """The sampler penalizes rows in place (C on CPU) and samples them in one
    call: greedy rows take the argmax of the penalized row, sampled ones draw
    from it, whoever else shares the batch."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 500, generator=g) * 3
    params = [SamplingParams(temperature=0, repetition_penalty=3.0), SamplingParams(temperature=0.7, seed=4,
                                                                                      presence_penalty=1.5),
              SamplingParams(temperature=0), SamplingParams(temperature=0, frequency_penalty=2.0)]
    seqs = [Sequence(f"r{i}", [int(logits[i].argmax()), 7], p) for i, p in enumerate(params)]
    seqs[1].output_counts = {int(logits[1].argmax()): 3}
    seqs[3].output_counts = {int(logits[3].argmax()): 2}
    toks = Sampler()(logits.clone(), seqs)[0]
    for i in (0, 3):
        ref = apply_penalties(logits[i], params[i], seqs[i].token_ids, seqs[i].output_counts)
        assert toks[i] == int(ref.argmax()) and toks[i] != int(logits[i].argmax())
    assert toks[2] == int(logits[2].argmax())
    alone = Sampler()(logits[1:2].clone(), seqs[1:2])[0]
    assert toks[1] == alone[0]


@pytest.mark.parametrize("rep,presence,freq,bias", [
    (1.3, 0.0, 0.0, None), (0.7, 0.5, 0.25, None), (1.0, -1.5, 2.0, {5: 3.5, 17: -100.0}),
    (2.0, 0.3, 0.1, {3: 0.25}), (5e-324, 0.0, 0.0, None), (9.9, 2.0, -2.0, {0: 100.0}),
])
def test_the_c_penalties_are_apply_penalties_bit_for_bit(rep, presence, freq, bias):
    from qoqserve.kernels.cpu import sample as cpu_sample
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 300, generator=g) * 4
    logits[0, :4] = torch.tensor([0.0, -0.0, float("-inf"), 1e-30])
    p = SamplingParams(temperature=0.5, repetition_penalty=rep, presence_penalty=presence,
                       frequency_penalty=freq, logit_bias=bias)
    prompts = [[0, 1, 2, 3, 3, 9], [5, 5, 5], list(range(0, 300, 7))]
    outputs = [{3: 2, 40: 1}, {}, {17: 5, 0: 1, 299: 3}]
    ref = torch.stack([apply_penalties(logits[i], p, prompts[i], outputs[i]) for i in range(3)])
    got = logits.clone()
    seen = [prompts[i] + [t for t, c in outputs[i].items() for _ in range(c)] for i in range(3)]
    cpu_sample.penalize_rows(got, [0, 1, 2], seen, outputs, [bias] * 3, [rep] * 3, [presence] * 3, [freq] * 3)
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))  # the same bits, signed zeros included


@pytest.mark.parametrize("vocab", [50, 1000, 49157])  # 49157: a tail past the last 16-wide block
def test_c_logprobs_are_log_softmax_and_its_topk(vocab):
    """logprobs.c against torch: every logprob within 4e-6 (a few ulp of
    logits ~10: the sums run in another order), the top ids exactly (ties:
    lower id first), masked -inf tokens at -inf."""
    from qoqserve.kernels.cpu import logprobs as cpu_logprobs

    torch.manual_seed(vocab)
    x = torch.randn(6, vocab) * 3
    x[1, ::7] = float("-inf")
    x[2, 10:14] = x[2].max() + 1  # four tied top tokens
    rows = [5, 1, 2, 0]
    shift, logsum, ids, lps = cpu_logprobs.logprob_rows(x, rows, 20)
    ref = torch.log_softmax(x[rows], -1)
    got = (x[rows] - shift[:, None]) - logsum[:, None]
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref))
    fin = torch.isfinite(ref)
    assert (got[fin] - ref[fin]).abs().max() < 4e-6
    order = torch.stack([torch.tensor(sorted(range(vocab), key=lambda t: (-float(x[i, t]), t))[:20]) for i in rows])
    assert torch.equal(ids, order) and ids[2, :4].tolist() == [10, 11, 12, 13]
    assert (lps - ref.gather(1, ids)).abs().max() < 4e-6
    assert cpu_logprobs.logprob_rows(x, rows, 0)[2].shape == (4, 0)


def test_logprobs_of_penalized_rows_are_the_models():
    """The sampler changes a penalized row's logits in place; the chosen
    token's logprob is still that of the logits it was given."""
    torch.manual_seed(1)
    logits = torch.randn(2, 300)
    ref = torch.log_softmax(logits, -1)
    second = [int(r.topk(2).indices[1]) for r in logits]  # positive logits: boosted by a penalty below 1
    params = [SamplingParams(temperature=0, repetition_penalty=0.1, logprobs=True, top_logprobs=3),
              SamplingParams(temperature=0.7, seed=2, logit_bias={second[1]: 100}, logprobs=True)]
    seqs = [Sequence("r0", [second[0]], params[0]), Sequence("r1", [1], params[1])]
    toks, lps, top = Sampler()(logits.clone(), seqs)
    assert toks == second  # the penalties chose them: their logits changed before the choice
    assert lps == pytest.approx([float(ref[i, t]) for i, t in enumerate(toks)], rel=1e-5)
    assert [t for t, _ in top[0]] == ref[0].topk(3).indices.tolist() and top[1] == []


def test_step_logprobs_torch_path_equals_the_c_path():
    """The path CUDA takes (torch's log_softmax and topk over the asking rows),
    run here on logits whose column stride the C kernel does not take."""
    from qoqserve.layers.token_logprobs import StepLogprobs

    torch.manual_seed(2)
    logits = torch.randn(4, 500)
    strided = logits.t().contiguous().t()
    tokens = torch.tensor([3, 1, 4, 1])
    c, t = (StepLogprobs(x, [0, 2, 3], [2, 0, 5], set()) for x in (logits, strided))
    assert c.on_cpu and not t.on_cpu
    (c_lp, c_top), (t_lp, t_top) = c.results(tokens, 4), t.results(tokens, 4)
    assert c_lp[1] is None and t_lp[1] is None and c_top[1] is None
    assert [v for v in c_lp if v is not None] == pytest.approx([v for v in t_lp if v is not None], abs=4e-6)
    for a, b in zip(c_top, t_top):
        assert (a is None) == (b is None)
        if a is not None:
            assert [i for i, _ in a] == [i for i, _ in b]
            assert [v for _, v in a] == pytest.approx([v for _, v in b], abs=4e-6)
