"""Page (block) allocation with reference counts and a hash-chained prefix cache.

A full block is identified by hash(previous block's hash, its tokens), so a
hit means the whole prefix up to and including that block matches. Hashes can
collide, so a hit is only taken when the stored tokens are equal too. A block
is registered only once its K/V are computed (prompts are prefilled in
chunks, over several steps). Freed blocks keep their contents and hash until
they are handed out again, so a later request can still hit them.

Where every layer's attention slides (a window), a running sequence gives
back the pages no later query of it reads, as vLLM does: those wholly before
the window of its next position, less one key tile (the prefill kernel reads
whole tiles of up to KEY_TILE positions from the one its first query's window
starts in, and masks them). Where only some layers slide and they have a
pool of their own (engine/window_pages.py), the sequence keeps its blocks
and gives back their sliding layers' pages instead, and it takes those pages
only for the blocks its next step computes (prefill chunks: `fit_chunk`),
not for a whole prompt at once.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from qoqserve.engine.sequence import Sequence
from qoqserve.engine.window_pages import KEY_TILE, WindowPages


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = field(default_factory=tuple)


class OutOfBlocksError(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None, window_pages: WindowPages | None = None):
        """window: the sliding window of the layers that slide, if every layer
        does (pages before it are given back while a sequence runs) or
        window_pages holds theirs (those pages are given back)."""
        self.block_size = block_size
        self.window = window
        self.window_pages = window_pages
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block: dict[int, int] = {}
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.used_ids: set[int] = set()
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0     # of those, tokens found

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    @property
    def usage(self) -> float:
        return len(self.used_ids) / self.num_blocks

    @staticmethod
    def chain_hash(tokens: tuple[int, ...], prev: int | None) -> int:
        return hash((prev, tokens))

    def _take_free(self, block_id: int | None = None) -> Block:
        if block_id is None:
            if not self.free_ids:
                raise OutOfBlocksError("no free KV pages")
            block_id = self.free_ids.popleft()
            block = self.blocks[block_id]
            if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]  # its old contents are about to be overwritten
            block.hash, block.token_ids = None, ()
        else:
            self.free_ids.remove(block_id)
            block = self.blocks[block_id]
        block.ref_count = 1
        self.used_ids.add(block_id)
        return block

    def _register(self, block: Block, tokens: tuple[int, ...], prev: int | None) -> int:
        h = self.chain_hash(tokens, prev)
        block.hash, block.token_ids = h, tokens
        if self.enable_prefix_caching:
            self.hash_to_block[h] = block.block_id
        return h

    def can_allocate(self, seq: Sequence) -> bool:
        return self.num_free_blocks >= seq.num_blocks(self.block_size) and (
            self.window_pages is None or self.window_pages.num_free > 0)

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """The blocks holding seq's leading full blocks of tokens, as far as the
        prefix cache has them all. The last token is always computed (its
        logits are needed), so a block holding it is never served from the cache."""
        bs = self.block_size
        hits: list[int] = []
        prev: int | None = None
        for i in range((len(seq) - 1) // bs if self.enable_prefix_caching else 0):
            tokens = tuple(seq.block_tokens(i, bs))
            prev = self.chain_hash(tokens, prev)
            hit_id = self.hash_to_block.get(prev)
            if hit_id is None or self.blocks[hit_id].token_ids != tokens:
                break
            hits.append(hit_id)
        if self.window_pages is not None:  # as far as the sliding layers' pages of the window before it last too
            while hits and not all(self.window_pages.has_page(b)
                                   for b in hits[self._first_in_window(len(hits) * bs):]):
                hits.pop()
        return hits

    def _first_in_window(self, position: int) -> int:
        """The first block a query at `position` reads in a sliding layer."""
        return max(0, (position - self.window + 1 - KEY_TILE) // self.block_size)

    def allocate(self, seq: Sequence) -> None:
        assert not seq.block_table
        bs = self.block_size
        hits = self._prefix_hits(seq)
        for hit_id in hits:
            if hit_id in self.used_ids:
                self.blocks[hit_id].ref_count += 1
            else:
                self._take_free(hit_id)
        seq.block_table = hits + [self._take_free().block_id for _ in range(seq.num_blocks(bs) - len(hits))]
        seq.num_cached_tokens = seq.num_computed_tokens = len(hits) * bs
        seq.num_hashed_blocks = len(hits)
        if self.window_pages is not None:  # the sliding layers' pages of the window its first query reads
            seq.num_released_blocks = seq.num_window_blocks = self._first_in_window(seq.num_cached_tokens)
            self._hold_window(seq, seq.num_cached_tokens)
        if self.enable_prefix_caching:
            self.prefix_queries += len(seq)
            self.prefix_hits += seq.num_cached_tokens

    def _window_need(self, seq: Sequence, end: int) -> int:
        """Sliding-layer pages seq lacks for its positions before `end`."""
        return max(0, -(-end // self.block_size) - seq.num_window_blocks)

    def _hold_window(self, seq: Sequence, end: int) -> None:
        for idx in range(seq.num_window_blocks, -(-end // self.block_size)):
            self.window_pages.hold(seq.block_table[idx])
            seq.num_window_blocks = idx + 1

    def fit_chunk(self, seq: Sequence, n: int) -> int:
        """How many of the next n prompt tokens of seq can be computed in one
        step (n, unless the sliding layers' pool is short), holding what they need."""
        if self.window_pages is None:
            return n
        start, free = seq.num_computed_tokens, self.window_pages.num_free
        n = min(n, max(0, (seq.num_window_blocks + free) * self.block_size - start))
        self._hold_window(seq, start + n)
        return n

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.used_ids.discard(block_id)
            self.free_ids.append(block_id)

    def deallocate(self, seq: Sequence) -> None:
        if self.window_pages is not None:
            for block_id in seq.block_table[seq.num_released_blocks:seq.num_window_blocks]:
                self.window_pages.drop(block_id)
            kept = seq.block_table
        else:
            kept = seq.block_table[seq.num_released_blocks:]
        for block_id in reversed(kept):
            self._release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = seq.num_hashed_blocks = seq.num_released_blocks = seq.num_window_blocks = 0

    def take_scratch(self, n: int) -> list[int] | None:
        """n free pages outside any sequence (a scored pass that writes K/V and
        keeps nothing; where the sliding layers have a pool, with theirs), or
        None when fewer are free; give them back with release_scratch. Their
        old contents leave the prefix cache."""
        if n > self.num_free_blocks or (self.window_pages is not None and n > self.window_pages.num_free):
            return None
        pages = [self._take_free().block_id for _ in range(n)]
        for block_id in pages if self.window_pages is not None else ():
            self.window_pages.hold(block_id)
        return pages

    def release_scratch(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if self.window_pages is not None:
                self.window_pages.drop(block_id)
            self.blocks[block_id].ref_count = 0
            self.used_ids.discard(block_id)
            self.free_ids.append(block_id)

    def _missing(self, seq: Sequence, ahead: int = 0) -> int:
        """Pages seq lacks for the slots up to `ahead` past its newest token's."""
        return max(0, -(-(len(seq) + ahead) // self.block_size) - len(seq.block_table))

    def can_append(self, seq: Sequence) -> bool:
        """Room for the slot of seq's newest token (appended, not yet computed)."""
        return self.reserve([seq], 0, take=False)

    def may_append(self, seq: Sequence) -> None:
        if not self.reserve([seq], 0):
            raise OutOfBlocksError("no free KV pages")

    def reserve(self, seqs: list[Sequence], ahead: int, take: bool = True) -> bool:
        """The pages of each seq's next `ahead` slots after its newest token's
        (a decode burst; 0: the newest token's own), if the pools have all of
        them; else none are taken (take=False: only whether they have)."""
        need = [self._missing(s, ahead) for s in seqs]
        wp = self.window_pages
        if sum(need) > self.num_free_blocks or (
                wp is not None and sum(self._window_need(s, len(s) + ahead) for s in seqs) > wp.num_free):
            return False
        if take:
            for seq, n in zip(seqs, need):
                seq.block_table.extend(self._take_free().block_id for _ in range(n))
                if wp is not None:
                    self._hold_window(seq, len(seq) + ahead)
        return True

    def on_tokens_computed(self, seq: Sequence) -> None:
        """Register, for reuse, every full block whose tokens are all computed now."""
        bs = self.block_size
        for idx in range(seq.num_hashed_blocks, seq.num_computed_tokens // bs):
            block = self.blocks[seq.block_table[idx]]
            prev = self.blocks[seq.block_table[idx - 1]].hash if idx > 0 else None
            if block.hash is None:
                self._register(block, tuple(seq.block_tokens(idx, bs)), prev)
            seq.num_hashed_blocks = idx + 1
        if self.window is not None:
            self._release_before_window(seq)

    def _release_before_window(self, seq: Sequence) -> None:
        """Give back seq's pages wholly before what its next query can read (the
        table keeps their ids: its positions still index it): the sliding
        layers' pages where they have a pool, else the blocks themselves, then
        only registered ones followed by a registered one (the next block's
        chain hash is read from the block before it)."""
        end = self._first_in_window(seq.num_computed_tokens)
        if self.window_pages is not None:
            # a block less: a prefix hit on seq's tokens ends at a block boundary
            # up to a block before its next position, and needs the window before it
            end = min(self._first_in_window(seq.num_computed_tokens - self.block_size), seq.num_window_blocks)
            for idx in range(seq.num_released_blocks, end):
                self.window_pages.drop(seq.block_table[idx], passed=True)
        else:
            end = min(end, seq.num_hashed_blocks - 1)
            for idx in range(seq.num_released_blocks, end):
                self._release(seq.block_table[idx])
        seq.num_released_blocks = max(seq.num_released_blocks, end)
