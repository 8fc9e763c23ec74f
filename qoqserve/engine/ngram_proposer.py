"""Draft tokens by n-gram lookup (vLLM's "ngram" speculative method, also
called prompt lookup decoding): when the last n tokens of a sequence
(prompt and output so far) occurred earlier in it, the tokens that followed
them there are proposed as its next ones. Text that quotes, copies or edits
what is already in the context (code, documents, JSON with repeated keys)
continues as it went before, often for many tokens.

n runs from prompt_lookup_max down to prompt_lookup_min: the longest
matching suffix wins, and of its occurrences the latest. Each sequence keeps
an index per n, {n-gram: where it last ended}, brought up to date with the
tokens appended since the last lookup, so a lookup costs a few dict probes,
not a scan of the context.
"""
from __future__ import annotations


class NgramIndex:
    """One sequence's n-grams, for every n of [n_min, n_max]."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        self.indexed = 0  # n-grams ending before this position are in the index

    def _catch_up(self, tokens: list[int]) -> None:
        # an n-gram is indexed once a token follows it, so the sequence's own
        # last n tokens never match themselves
        for end in range(max(self.indexed, self.n_min), len(tokens)):
            for n, index in self.ends.items():
                if n <= end:
                    index[tuple(tokens[end - n:end])] = end
        self.indexed = max(self.indexed, len(tokens))

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the
        longest suffix of tokens found; [] when none is."""
        if k <= 0:
            return []
        self._catch_up(tokens)
        for n in range(min(self.n_max, len(tokens) - 1), self.n_min - 1, -1):
            end = self.ends[n].get(tuple(tokens[len(tokens) - n:]))
            if end is not None:
                return tokens[end:end + k]
        return []
