"""Drawing a token from a row of logits (layers/token_draw.py): the C kernel
(kernels/cpu/sample.c) and the batched torch path keep the same tokens by
vLLM's min_p / top_k / top_p rules and draw them in proportion, checked
against a float64 sort-based reference over a grid of uniforms."""
from __future__ import annotations

import pytest
import torch

from qoqserve.kernels.cpu import sample as cpu_sample
from qoqserve.layers.token_draw import draw_torch

GRID = 4000
IMPLS = ["c", "torch"]


def draws(impl: str, row: torch.Tensor, t: float = 1.0, min_p: float = 0.0, top_k: int = -1,
          top_p: float = 1.0, n: int = GRID) -> torch.Tensor:
    """The token at each of n evenly spaced uniforms."""
    u = [(j + 0.5) / n for j in range(n)]
    settings = ([t] * n, [min_p] * n, [top_k] * n, [top_p] * n, u)
    if impl == "c":
        return torch.tensor(cpu_sample.sample_rows(row[None].float().contiguous(), [0] * n, *settings))
    return torch.tensor(draw_torch(row[None].float().expand(n, -1), *settings))


def reference(row: torch.Tensor, t: float, min_p: float, top_k: int, top_p: float) -> torch.Tensor:
    """The kept tokens' probabilities (float64, sorted filters, ties kept)."""
    w = torch.exp((row.double() - row.max()) / t)
    w = torch.where(w < min_p, 0.0, w)
    if 0 < top_k < len(w):
        w = torch.where(w < w.sort(descending=True).values[top_k - 1], 0.0, w)
    if top_p < 1:
        heavier = torch.where(w[None, :] > w[:, None], w[None, :], 0.0).sum(-1)  # [i]: the weight above w[i]
        w = torch.where(heavier < top_p * w.sum(), w, 0.0)
    return w / w.sum()


@pytest.mark.parametrize("impl", IMPLS)
def test_the_rules_keep_the_right_tokens(impl):
    row = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])  # probabilities ~.64 .24 .09 .03 .01
    kept = lambda **kw: sorted(set(draws(impl, row, **kw).tolist()))  # noqa: E731
    assert kept() == [0, 1, 2, 3, 4]
    assert kept(top_k=2) == [0, 1]
    assert kept(top_p=0.8) == [0, 1] and kept(top_p=0.5) == [0]
    assert kept(min_p=0.3) == [0, 1] and kept(min_p=0.1) == [0, 1, 2]  # e^-1 = .37, e^-2 = .14
    # top_p of what top_k left (weights 1, .37, .14): token 2 has 1.37 of 1.50 heavier, over 0.9 of it
    assert kept(top_k=3, top_p=0.9) == [0, 1]
    ties = torch.tensor([5.0, 3.0, 3.0, 3.0, 1.0])
    assert sorted(set(draws(impl, ties, top_k=2).tolist())) == [0, 1, 2, 3]  # the k-th's ties stay
    # weights 1, .135 x 3, .018: the tied three have 1 of 1.42 heavier, below .75 of it, and stay together
    assert sorted(set(draws(impl, ties, top_p=0.75).tolist())) == [0, 1, 2, 3]
    assert sorted(set(draws(impl, ties, top_p=0.7).tolist())) == [0]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("t,min_p,top_k,top_p", [(1.0, 0.0, -1, 1.0), (0.7, 0.0, 50, 1.0), (0.8, 0.0, -1, 0.9),
                                                 (0.7, 0.02, 40, 0.95), (1.3, 0.05, -1, 0.8)])
def test_draws_follow_the_kept_distribution(impl, t, min_p, top_k, top_p):
    g = torch.Generator().manual_seed(3)
    row = torch.randn(1000, generator=g) * 2.5
    ref = reference(row, t, min_p, top_k, top_p)
    counts = torch.bincount(draws(impl, row, t, min_p, top_k, top_p), minlength=1000).double() / GRID
    assert set(counts.nonzero()[:, 0].tolist()) <= set(ref.nonzero()[:, 0].tolist())
    # an evenly spaced grid: each token's share is its probability within 1/GRID (a share below that may be 0)
    assert (counts - ref).abs().max() <= 1.01 / GRID


def test_c_and_torch_agree_on_a_vocabulary_sized_row():
    g = torch.Generator().manual_seed(5)
    row = torch.randn(49152, generator=g) * 3
    row[:20] += 10
    for kw in (dict(t=0.8), dict(t=0.8, top_p=0.95), dict(t=0.7, top_k=50), dict(t=1.0, min_p=0.05, top_p=0.9)):
        c, tr = draws("c", row, **kw, n=400), draws("torch", row, **kw, n=400)
        # the same rules; exp and the sums round apart, so a draw next to a token's edge may cross it
        assert (c == tr).float().mean() >= 0.995, kw


@pytest.mark.parametrize("impl", IMPLS)
def test_masked_nan_and_overflowing_rows(impl):
    row = torch.tensor([1.0, float("-inf"), 2.0, float("nan"), 0.5])
    assert set(draws(impl, row).tolist()) == {0, 2, 4}  # never a masked or NaN token
    assert set(draws(impl, row, t=1e-30).tolist()) == {2}  # a vanishing temperature is the argmax
    inf = torch.tensor([1.0, float("inf"), 2.0, float("inf")])  # a penalty overflowed
    assert sorted(set(draws(impl, inf).tolist())) == [1, 3]


def test_the_server_takes_min_p(server):
    import httpx

    def ask(**kw):
        return httpx.post(server.base + "/v1/completions", headers={"Authorization": "Bearer test-key"}, timeout=60,
                          json={"prompt": "The colour of the sky is", "max_tokens": 8, **kw})
    greedy = ask(temperature=0).json()["choices"][0]["text"]
    # min_p 1 keeps only the most likely token: sampling at any temperature is greedy
    assert ask(temperature=1.5, min_p=1.0, seed=3).json()["choices"][0]["text"] == greedy
    bad = ask(min_p=1.5)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "min_p"
