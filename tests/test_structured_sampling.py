"""Constraint masks in the sampler: the C bitmask kernel against a torch
reference, and every sampling mode drawing only what a constraint allows
while the unconstrained rows of the batch draw what they would alone."""
from __future__ import annotations

import pytest
import torch

from qoqserve.engine.sequence import Sequence
from qoqserve.errors import ConstraintDeadEndError
from qoqserve.kernels.cpu import token_mask as cpu_token_mask
from qoqserve.layers.sampler import Sampler, apply_penalties
from qoqserve.layers.token_mask import (
    apply_token_bitmask,
    apply_token_bitmask_reference,
    bitmask_words,
    rows_left_empty,
    rows_left_empty_reference,
)
from qoqserve.sampling_params import InvalidSamplingParams, SamplingParams, StructuredOutputs


def random_bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Random words, with whole words of ones and of zeros mixed in (the kernel's fast cases)."""
    g = torch.Generator().manual_seed(seed)
    words = bitmask_words(vocab)
    mask = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32, generator=g)
    kind = torch.randint(0, 3, (rows, words), generator=g)
    mask[kind == 0] = -1
    mask[kind == 1] = 0
    return mask


def allowed_of(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """The plain meaning of a bitmask, bit by bit in Python (the reference's reference)."""
    return torch.tensor([[bool((int(w) >> (t % 32)) & 1) for t in range(vocab) for w in [row[t // 32]]]
                         for row in mask.tolist()])


@pytest.mark.parametrize("vocab", [64, 1000, 49152])
def test_bitmask_kernel_masks_exactly_the_disallowed_tokens(vocab):
    assert cpu_token_mask.available(), "the C kernel must build here (the torch path is the fallback)"
    logits = torch.randn(6, vocab)
    rows = [0, 2, 3, 5]
    mask = random_bitmask(len(rows), vocab, seed=vocab)
    got, ref = logits.clone(), logits.clone()
    apply_token_bitmask(got, mask, rows)
    apply_token_bitmask_reference(ref, mask, rows)
    assert torch.equal(got, ref)
    # -inf exactly where a listed row's bit is 0; everything else untouched, bit for bit
    expect = logits.clone()
    if vocab <= 1000:
        allowed = allowed_of(mask, vocab)
        for j, r in enumerate(rows):
            expect[r, ~allowed[j]] = float("-inf")
        assert torch.equal(got, expect)
    assert torch.equal(got[[1, 4]], logits[[1, 4]])
    assert torch.isneginf(got[rows]).sum() > 0 and torch.isfinite(got[rows]).sum() > 0


@pytest.mark.parametrize("vocab", [1, 33, 49152])
def test_empty_row_kernel_names_exactly_the_rows_with_nothing_left(vocab):
    """Rows all -inf are named, in the order given; one finite logit anywhere
    (first, last, or a NaN, which isneginf does not count) keeps a row alive."""
    ninf = float("-inf")
    logits = torch.full((7, vocab), ninf)
    logits[1, vocab - 1] = 0.5     # alive only at the last token
    logits[3, 0] = -1e30           # alive only at the first
    logits[4, vocab // 2] = float("nan")
    logits[6] = torch.randn(vocab)
    for rows in ([0, 1, 2, 3, 4, 5, 6], [5, 2, 0], [6, 1], []):
        got = rows_left_empty(logits, rows)
        assert got == rows_left_empty_reference(logits, rows) if rows else got == []
        assert got == [r for r in rows if r in (0, 2, 5)]
    strided = torch.full((3, vocab + 5), 1.0)[:, :vocab]  # a view: row stride is not vocab
    strided[1] = ninf
    assert rows_left_empty(strided, [0, 1, 2]) == [1]
    with pytest.raises(ValueError, match="outside"):
        cpu_token_mask.rows_left_empty(logits, torch.tensor([7]))


class FixedConstraint:
    """A TokenConstraint allowing a fixed set of tokens."""

    def __init__(self, allowed: list[int]):
        self.allowed = allowed

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        for t in self.allowed:
            w = int(bitmask[row, t // 32]) & 0xFFFFFFFF | (1 << (t % 32))
            bitmask[row, t // 32] = w - (1 << 32) if w >= 2**31 else w


MODES = [dict(temperature=0), dict(temperature=0, repetition_penalty=1.3), dict(temperature=1.0, seed=1),
         dict(temperature=0.7, top_k=3, seed=2), dict(temperature=1.2, top_p=0.5, seed=3),
         dict(temperature=1.0, presence_penalty=1.0, frequency_penalty=0.5, seed=4),
         dict(temperature=1e-30, seed=5), dict(temperature=0, logprobs=True, top_logprobs=3),
         dict(temperature=0, repetition_penalty=5e-324), dict(temperature=1.0, repetition_penalty=5e-324, seed=6)]


@pytest.mark.parametrize("mode", MODES, ids=[",".join(f"{k}={v}" for k, v in m.items()) for m in MODES])
def test_every_sampling_mode_draws_only_allowed_tokens_and_free_rows_are_unchanged(mode):
    torch.manual_seed(0)
    vocab, allowed = 300, [5, 37, 64, 65, 299]
    logits = torch.randn(4, vocab) * 3
    logits[:, 7] = 50.0  # the model's favourite is disallowed
    free = SamplingParams(temperature=1.0, seed=9)
    batch = [Sequence(f"c{i}", [1, 7, 5], SamplingParams(**mode), constraint=FixedConstraint(allowed))
             for i in range(2)]
    batch.insert(1, Sequence("free", [1, 7], free))
    batch.append(Sequence("greedy", [1], SamplingParams(temperature=0)))
    for _ in range(5):
        toks, lps, top = Sampler(seed=0)(logits, batch)
        assert toks[0] in allowed and toks[2] in allowed
        if mode.get("logprobs"):
            assert all(t in allowed for t, _ in top[0]) and lps[0] > float("-inf")
    alone = Sampler(seed=0)(logits[[1, 3]], [batch[1], batch[3]])[0]
    assert [toks[1], toks[3]] == alone == [Sampler(seed=0)(logits[[1]], [batch[1]])[0][0], 7]


def test_the_steps_greedy_tokens_are_taken_unless_a_constraint_masked_the_logits():
    # a captured step hands the sampler each row's argmax; the sampler takes
    # those for greedy rows (given here deliberately different from the
    # logits' argmax, to see which it took), samples other rows as ever, and
    # once a constraint has masked rows it takes the argmax of the masked logits
    logits = torch.randn(3, 300) * 3
    logits[:, 7] = 50.0
    given = torch.tensor([11, 12, 13])
    free = [Sequence("g0", [1], SamplingParams(temperature=0)),
            Sequence("pen", [1, 7], SamplingParams(temperature=0, repetition_penalty=10.0)),
            Sequence("g2", [1], SamplingParams(temperature=0))]
    toks = Sampler()(logits.clone(), free, greedy=given)[0]
    assert toks[0] == 11 and toks[2] == 13
    assert toks[1] == int(apply_penalties(logits[1], free[1].params, [1, 7], {}).argmax())  # its own argmax
    assert given.tolist() == [11, 12, 13]  # the step's buffer is not written
    assert Sampler()(logits.clone(), [free[0], free[2]], greedy=given[:2])[0] == [11, 12]  # all greedy rows
    masked = [free[0], Sequence("c", [1], SamplingParams(temperature=0), constraint=FixedConstraint([5, 9])),
              free[2]]
    toks = Sampler()(logits.clone(), masked, greedy=given)[0]
    assert toks[0] == 7 and toks[1] in (5, 9) and toks[2] == 7


def test_structured_outputs_spec_is_checked_and_normalized():
    a = StructuredOutputs(json='{"type": "object"}')
    assert a.key() == StructuredOutputs(json={"type": "object"}).key() and a.kind == "json"
    assert StructuredOutputs(choice=["a", "b"]).choice == ("a", "b")
    for bad in [dict(), dict(regex="a", choice=["b"]), dict(json="{not json"), dict(json=[1]),
                dict(choice=[]), dict(grammar=""), dict(structural_tag="[1]")]:
        with pytest.raises(InvalidSamplingParams):
            StructuredOutputs(**bad)
    with pytest.raises(InvalidSamplingParams):
        SamplingParams(structured_outputs={"regex": "a"})


def test_a_row_with_no_allowed_token_names_its_request_instead_of_sampling_nan():
    logits = torch.randn(3, 300)
    batch = [Sequence("ok", [1], SamplingParams(temperature=1.0, seed=1), constraint=FixedConstraint([5])),
             Sequence("dead", [1], SamplingParams(temperature=1.0, seed=2), constraint=FixedConstraint([])),
             Sequence("free", [1], SamplingParams(temperature=0))]
    with pytest.raises(ConstraintDeadEndError) as e:
        Sampler(seed=0)(logits.clone(), batch)
    assert e.value.request_ids == ["dead"] and e.value.code == "constraint_dead_end"
    toks, _, _ = Sampler(seed=0)(logits[[0, 2]], [batch[0], batch[2]])
    assert toks == [5, int(logits[2].argmax())]
