"""Filler prose for the long-context tasks, generated from our own word lists.

Every sentence is drawn from the small grammar below with a seeded generator,
so the text is ours to redistribute, the same on every machine, and as long
as a task needs (8k tokens and more). It is plain narrative English that says
nothing a pass key could be confused with (no digits), and tests/test_quality
checks that it shares no 12-token run with the calibration text.
"""
from __future__ import annotations

import random

_SUBJECTS = (
    "the old miller", "a young painter", "the harbor master", "my neighbor", "the village baker",
    "a tired traveler", "the gardener", "her younger brother", "the shepherd", "a quiet student",
    "the ferryman", "the potter's daughter", "a stranger in a gray coat", "the carpenter",
    "our teacher", "the night watchman", "a group of children", "the weaver", "the cook",
)
_VERBS = (
    "walked slowly toward", "painted a picture of", "talked for a while about", "looked for",
    "carried a basket to", "wrote a short letter about", "sat quietly beside", "repaired",
    "sang an old song about", "dreamed of", "cleaned", "waited patiently near", "remembered",
    "drew a map of", "told a long story about", "planted flowers around", "swept the path to",
)
_OBJECTS = (
    "the wooden bridge", "the green hills", "a small boat", "the bakery on the corner",
    "the stone well", "an empty barn", "the orchard", "the narrow street", "the lighthouse",
    "the market square", "a field of barley", "the little chapel", "the river bank",
    "the old library", "the windmill", "a quiet pond", "the forest path", "the town hall",
)
_TAILS = (
    "before the sun went down", "while the wind was blowing", "after the rain had stopped",
    "early in the morning", "as the bells began to ring", "without saying a word",
    "on a cold afternoon", "when the market was closing", "under a pale sky", "for most of the day",
    "as the birds flew south", "while the kettle was boiling", "in the soft evening light",
)
_LINKS = ("Later,", "Meanwhile,", "Afterwards,", "Then", "That evening,", "Soon", "Once again,")


def _sentence(rng: random.Random) -> str:
    subject = rng.choice(_SUBJECTS)
    link = rng.choice(_LINKS) + " " if rng.random() < 0.3 else ""
    if link:
        body = f"{link}{subject}"
    else:
        body = subject[0].upper() + subject[1:]
    return f"{body} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}."


def filler_sentences(seed: int):
    """An endless stream of sentences, a blank line every few of them."""
    rng = random.Random(seed)
    while True:
        for i in range(rng.randint(3, 6)):
            yield _sentence(rng) + " "
        yield "\n\n"


def filler_pieces(tokenizer, num_tokens: int, seed: int) -> tuple[list[str], list[int]]:
    """As many sentences (and paragraph breaks) as fit in num_tokens tokens,
    with each one's count. A piece is counted without its trailing space,
    which the next word absorbs when they are joined, so the sum matches the
    joined text's count to within a few tokens."""
    pieces, counts = [], []
    for s in filler_sentences(seed):
        n = len(tokenizer.encode(s.rstrip(" "), add_special_tokens=False))
        if sum(counts) + n > num_tokens:
            return pieces, counts
        pieces.append(s)
        counts.append(n)


def filler_text(tokenizer, num_tokens: int, seed: int) -> str:
    return "".join(filler_pieces(tokenizer, num_tokens, seed)[0]).strip()
