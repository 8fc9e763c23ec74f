"""Hadamard and orthogonal matrices for rotating the residual stream.

A Hadamard matrix spreads each outlier channel evenly over all channels, so it
is the preferred rotation; hidden sizes that are not powers of two (SmolLM2:
576 = 36 x 16) need a Paley-built factor. When no construction is known we
fall back to a random orthogonal matrix, which spreads outliers almost as well.
"""
from __future__ import annotations

import torch

from qoqserve.layers.key_transform import sylvester


def _is_prime(q: int) -> bool:
    if q < 2:
        return False
    f = 2
    while f * f <= q:
        if q % f == 0:
            return False
        f += 1
    return True


def _jacobsthal(q: int) -> torch.Tensor:
    """Q[i, j] = chi(j - i) with chi the quadratic character of GF(q), q prime."""
    squares = torch.zeros(q, dtype=torch.int64)
    squares[(torch.arange(1, q) ** 2) % q] = 1
    chi = torch.where(squares.bool(), 1, -1)
    chi[0] = 0
    idx = (torch.arange(q)[None, :] - torch.arange(q)[:, None]) % q
    return chi[idx]


def _paley1(q: int) -> torch.Tensor:
    """Order q + 1 for prime q = 3 (mod 4): Q is skew, so H = I + S is Hadamard."""
    s = torch.zeros(q + 1, q + 1, dtype=torch.int64)
    s[0, 1:] = 1
    s[1:, 0] = -1
    s[1:, 1:] = _jacobsthal(q)
    return s + torch.eye(q + 1, dtype=torch.int64)


def _paley2(q: int) -> torch.Tensor:
    """Order 2(q + 1) for prime q = 1 (mod 4) from the symmetric conference matrix."""
    c = torch.zeros(q + 1, q + 1, dtype=torch.int64)
    c[0, 1:] = 1
    c[1:, 0] = 1
    c[1:, 1:] = _jacobsthal(q)
    # zeros (the diagonal) become [[1,-1],[-1,-1]], +-1 entries +-[[1,1],[1,-1]]
    on_zero = torch.tensor([[1, -1], [-1, -1]])
    on_one = torch.tensor([[1, 1], [1, -1]])
    eye = torch.eye(q + 1, dtype=torch.int64)
    return torch.kron(c, on_one) + torch.kron(eye, on_zero)


def _base(m: int) -> torch.Tensor | None:
    if m in (1, 2):
        return sylvester(m, torch.int64)
    if m % 4:
        return None
    if _is_prime(m - 1) and (m - 1) % 4 == 3:
        return _paley1(m - 1)
    if _is_prime(m // 2 - 1) and (m // 2 - 1) % 4 == 1:
        return _paley2(m // 2 - 1)
    return None


def hadamard_matrix(n: int) -> torch.Tensor | None:
    """An unnormalised +-1 Hadamard matrix (float64) of order n, or None.

    Built as Sylvester(2^k) (x) H_m with H_m from Paley I or II; the largest
    power-of-two factor is tried first because Sylvester blocks are the
    cheapest to apply if a fast transform is ever used.
    """
    if n < 1:
        raise ValueError(f"order must be positive, got {n}")
    k = (n & -n).bit_length() - 1  # power of two dividing n
    for e in range(k, -1, -1):
        base = _base(n >> e)
        if base is not None:
            return torch.kron(sylvester(1 << e, torch.int64), base).to(torch.float64)
    return None


def random_orthogonal(n: int, seed: int | None = 0) -> torch.Tensor:
    """Haar-distributed orthogonal matrix (float64): QR of a Gaussian, sign-fixed.

    Fixing the signs of R's diagonal makes the result a deterministic function
    of the Gaussian draw (QR alone is unique only up to column signs).
    """
    gen = None
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    return q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, 1.0)[None, :]


def orthogonal_matrix(n: int, seed: int | None = 0, dtype=torch.float64) -> torch.Tensor:
    """An n x n orthogonal matrix: H diag(random signs) / sqrt(n) when a Hadamard
    of order n is known, else a random orthogonal matrix.

    seed=None keeps the plain (unsigned) Hadamard, and draws the fallback from
    torch's global RNG. Random signs decorrelate the rotation from any
    structure the weights share with the Hadamard pattern (as in QuaRot).
    """
    h = hadamard_matrix(n)
    if h is None:
        return random_orthogonal(n, seed).to(dtype)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        signs = torch.randint(0, 2, (n,), generator=gen, dtype=torch.float64) * 2 - 1
        h = h * signs[None, :]
    return (h / n ** 0.5).to(dtype)
