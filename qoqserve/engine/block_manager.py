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
starts in, and masks them).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from qoqserve.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = field(default_factory=tuple)


class OutOfBlocksError(RuntimeError):
    pass


KEY_TILE = 64  # the widest key tile of the prefill kernels (kernels/cpu/paged_prefill*.h)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None):
        """window: the sliding window of every layer's attention, if they all
        slide (pages before it are given back while a sequence runs)."""
        self.block_size = block_size
        self.window = window
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
        return self.num_free_blocks >= seq.num_blocks(self.block_size)

    def allocate(self, seq: Sequence) -> None:
        assert not seq.block_table
        bs = self.block_size
        # The last token is always computed (its logits are needed), so a block
        # holding it is never served from the cache.
        cacheable = (len(seq) - 1) // bs if self.enable_prefix_caching else 0
        prev: int | None = None
        missed = False
        seq.num_cached_tokens = 0
        for i in range(seq.num_blocks(bs)):
            tokens = tuple(seq.block_tokens(i, bs))
            full = len(tokens) == bs
            h = self.chain_hash(tokens, prev) if full else None
            hit_id = self.hash_to_block.get(h) if (i < cacheable and not missed) else None
            if hit_id is not None and self.blocks[hit_id].token_ids == tokens:
                block = self.blocks[hit_id]
                if hit_id in self.used_ids:
                    block.ref_count += 1
                else:
                    self._take_free(hit_id)
                seq.num_cached_tokens += bs
            else:
                missed = True
                block = self._take_free()
            prev = h
            seq.block_table.append(block.block_id)
        seq.num_computed_tokens = seq.num_cached_tokens
        seq.num_hashed_blocks = seq.num_cached_tokens // bs
        if self.enable_prefix_caching:
            self.prefix_queries += len(seq)
            self.prefix_hits += seq.num_cached_tokens

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.used_ids.discard(block_id)
            self.free_ids.append(block_id)

    def deallocate(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table[seq.num_released_blocks:]):
            self._release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = seq.num_hashed_blocks = seq.num_released_blocks = 0

    def take_scratch(self, n: int) -> list[int] | None:
        """n free pages outside any sequence (a scored pass that writes K/V and
        keeps nothing), or None when fewer are free; give them back with
        release_scratch. Their old contents leave the prefix cache."""
        if n > self.num_free_blocks:
            return None
        return [self._take_free().block_id for _ in range(n)]

    def release_scratch(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            self.blocks[block_id].ref_count = 0
            self.used_ids.discard(block_id)
            self.free_ids.append(block_id)

    def _missing(self, seq: Sequence, ahead: int = 0) -> int:
        """Pages seq lacks for the slots up to `ahead` past its newest token's."""
        return max(0, -(-(len(seq) + ahead) // self.block_size) - len(seq.block_table))

    def can_append(self, seq: Sequence) -> bool:
        """Room for the slot of seq's newest token (appended, not yet computed)."""
        return self.num_free_blocks >= self._missing(seq)

    def may_append(self, seq: Sequence) -> None:
        for _ in range(self._missing(seq)):
            seq.block_table.append(self._take_free().block_id)

    def reserve(self, seqs: list[Sequence], ahead: int) -> bool:
        """The pages of each seq's next `ahead` slots after its newest token's
        (a decode burst; 0: the newest token's own), if the pool has all of
        them; else none are taken."""
        need = [self._missing(s, ahead) for s in seqs]
        if sum(need) > self.num_free_blocks:
            return False
        for seq, n in zip(seqs, need):
            seq.block_table.extend(self._take_free().block_id for _ in range(n))
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
        table keeps their ids: its positions still index it). Only registered
        pages followed by a registered one: the next page's chain hash is read
        from the page before it."""
        first_read = seq.num_computed_tokens - self.window + 1 - KEY_TILE
        end = min(first_read // self.block_size, seq.num_hashed_blocks - 1)
        for idx in range(seq.num_released_blocks, end):
            self._release(seq.block_table[idx])
        seq.num_released_blocks = max(seq.num_released_blocks, end)
