"""The sliding layers' own page pool, where a model mixes sliding and full
attention (Gemma 2 and 3, Qwen2 with max_window_layers): what vLLM's hybrid
KV-cache manager and llama.cpp's SWA cache do.

Every block of a sequence's table keeps its full-attention layers' K/V in the
main pool for as long as the sequence runs; its sliding layers' K/V need
only live while some query can still read them. So the sliding layers get a
smaller pool of their own, and each block of the main pool is lent a page of
it while a sequence needs that block's window K/V. The page of a block is a
function of the block alone (a block's tokens and positions fix its K/V), so
sequences that share a block through the prefix cache share its page, and
the model finds a sliding layer's slots and tables by mapping each block id
through one table (`take_updates`, applied by the model runner: layers/page_map.py).

A page whose last holder lets go stays tied to its block until the page is
lent again, so a later prefix hit can still use it, as the main pool keeps
freed blocks' hashes. Pages a running sequence's window has passed are lent
again before those its end held (a finished sequence's last window, which a
next turn of its conversation, or the same prompt again, hits): least
recently let go first within each.
"""
from __future__ import annotations

import math
from collections import OrderedDict

KEY_TILE = 64  # the widest key tile of the prefill kernels (kernels/cpu/paged_prefill*.h)


def window_span_blocks(window: int, block_size: int) -> int:
    """Blocks a sequence holds the pages of between steps: its next query's
    window (its `window` positions, the key tile the prefill kernel starts
    from before them, the block it is in) and a block before, which a prefix
    hit ending at its last block boundary reads (BlockManager._release_before_window)."""
    return math.ceil((window - 1 + KEY_TILE) / block_size) + 2


def window_pool_size(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                     lookahead: int, max_len: int) -> int:
    """Pages that let every running sequence move on, and keep as many
    finished ones' last windows for prefix hits (a conversation's next turn):
    each running one holds its window's span plus the blocks of what it
    computes next (a decode burst's or a draft's `lookahead` slots), or all
    of its at most max_len positions; one step's prompt chunks take at most
    max_num_batched_tokens slots more."""
    span = min(window_span_blocks(window, block_size), math.ceil(max_len / block_size))
    per_seq = min(span + math.ceil(lookahead / block_size) + 1, math.ceil(max_len / block_size) + 1)
    return max_num_seqs * (per_seq + span) + math.ceil(max_num_batched_tokens / block_size)


class OutOfWindowPagesError(RuntimeError):
    pass


class WindowPages:
    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.pad_page = num_pages  # the runner's extra page: padding rows, and blocks with no page
        self.page_of: dict[int, int] = {}              # block id -> its page
        self.block_of: list[int | None] = [None] * num_pages
        self.refs = [0] * num_pages
        # free pages, in the order they are lent: those passed by a window, then
        # the rest (ordered sets: a hit takes a page back from the middle)
        self.passed: OrderedDict[int, None] = OrderedDict()
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))
        self._updates: dict[int, int] = {}             # block id -> page, not yet in the runner's map

    @property
    def num_free(self) -> int:
        return len(self.passed) + len(self.free)

    def has_page(self, block_id: int) -> bool:
        return block_id in self.page_of

    def hold(self, block_id: int) -> None:
        """One more holder of block_id's page (lent now if it has none)."""
        page = self.page_of.get(block_id)
        if page is None:
            if not self.num_free:
                raise OutOfWindowPagesError("no free pages for the sliding layers")
            page = (self.passed or self.free).popitem(last=False)[0]
            old = self.block_of[page]
            if old is not None:  # the block it was tied to loses it
                del self.page_of[old]
                self._updates[old] = self.pad_page
            self.page_of[block_id], self.block_of[page] = page, block_id
            self._updates[block_id] = page
        elif self.refs[page] == 0:
            (self.passed if page in self.passed else self.free).pop(page)
        self.refs[page] += 1

    def drop(self, block_id: int, passed: bool = False) -> None:
        """One holder less; passed: its window has moved past the block."""
        page = self.page_of[block_id]
        self.refs[page] -= 1
        if self.refs[page] == 0:
            (self.passed if passed else self.free)[page] = None

    def take_updates(self) -> list[tuple[int, int]]:
        """(block id, page) pairs changed since the last call (pad_page: none)."""
        out = list(self._updates.items())
        self._updates.clear()
        return out
