"""Decode steps replayed from captured graphs (CPU), the CPU counterpart of
the CUDA graphs GPU engines replay.

A decode step of B sequences always makes the same kernel calls; what
changes are the inputs (token ids, positions, slots, context lengths, block
tables). So for each batch size in `capture_sizes` the model's forward is
run once while kernels/cpu/graph.py records every C call, with its inputs
in persistent buffers owned here; later steps of that size write their
inputs into those buffers and replay the calls from a list, with no module,
dispatcher or allocator work in between. A batch between two sizes runs in
the next larger graph: its padding rows read token 0 at position 0, write
their K/V into a scratch page no sequence owns and attend to nothing, and
every kernel computes each row on its own, so the real rows' results are
unchanged (tests check it).

The LM head is captured apart, once per row count b (1 up to the largest
size; at start-up the largest and 1, the others when first needed), and a
step of b rows replays its decode graph and then the head over the b real
rows as one graph (StepGraph.then: one native plan, one team of
threads): a padded row would cost a vocabulary GEMV, and the head as a
module call allocates a fresh logits tensor per step. Where the head cannot
be recorded, it runs op by op after the replay. With the head, each row's
greedy token (the argmax of its logits) is computed in the step by the
threads that wrote each share of the logits: the sampler reading all of a
row after the step finds it cold in the other core's cache.

Decode bursts (engine/burst.py) replay these steps several times in one call
(engine/captured_burst.py).

Every graph's intermediate buffers are placed in one arena (buffer_plan.py:
buffers not in use at once share memory), so a step writes a few buffers
that stay in cache from layer to layer, not a fresh one per layer and call;
each graph's outputs keep their own.

Anything the forward runs that is not a replayable C kernel makes the
capture fail (graph.CaptureError); the engine then runs op by op and says
so once. `enforce_eager` never captures.
"""
from __future__ import annotations

import bisect
import logging
import time

import torch

from qoqserve.engine.captured_burst import CapturedBursts
from qoqserve.engine.sequence import Sequence
from qoqserve.engine.step_inputs import Row, decode_rows
from qoqserve.kernels.cpu import elementwise, graph
from qoqserve.kernels.cpu.buffer_plan import Arena
from qoqserve.layers.attention import AttentionMetadata
from qoqserve.layers.page_map import PageMap

log = logging.getLogger(__name__)


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """Every size up to 8, then steps of 8: capturing is one recorded step
    each and every graph shares the largest one's buffers, so the sizes can
    be dense and padding stays under 8 rows."""
    sizes = list(range(1, min(8, max_num_seqs) + 1)) + list(range(16, max_num_seqs + 1, 8))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def write_decode_row(bufs: dict, i: int, row: Row, block_size: int) -> None:
    """Row i of a captured step's input buffers (numpy views keyed ids,
    positions, slots, context_lens) as `row` (step_inputs.decode_rows: a
    sequence's next decode token, or a draft token verified:
    engine/speculative.py), attending to the positions up to its own."""
    seq, pos, token = row
    bufs["ids"][i] = token
    bufs["positions"][i] = pos
    bufs["slots"][i] = seq.slot(pos, block_size)
    bufs["context_lens"][i] = pos + 1


def pad_decode_rows(bufs: dict, lo: int, hi: int, pad_slot: int) -> None:
    """Rows lo..hi as padding: token 0 at position 0, written to the scratch
    slot, attending to nothing."""
    bufs["ids"][lo:hi] = 0
    bufs["positions"][lo:hi] = 0
    bufs["slots"][lo:hi] = pad_slot
    bufs["context_lens"][lo:hi] = 0


def reset_decode_rows(bufs: dict, held: list[tuple | None], lo: int, hi: int, pad_slot: int) -> None:
    """Rows lo..hi as padding (pad_decode_rows), holding no block table
    (held: write_decode_inputs's)."""
    pad_decode_rows(bufs, lo, hi, pad_slot)
    held[lo:hi] = [None] * (hi - lo)


def bucket_size(sizes: list[int], batch_size: int) -> int | None:
    """The smallest of the sorted captured `sizes` that holds the batch (None: none does)."""
    return sizes[bisect.bisect_left(sizes, batch_size)] if batch_size <= sizes[-1] else None


def write_decode_inputs(bufs: dict, held: list[tuple | None], rows, block_size: int) -> None:
    """Rows 0.. of a captured step's input buffers (write_decode_row's, plus
    block_tables) for `rows` (step_inputs.decode_rows). held[i]: (request,
    preemptions, blocks written) of what row i's block table holds, kept
    across steps: block tables only grow while a sequence runs (a preemption
    gives it a new one), so only the blocks a row does not hold yet are
    written."""
    tables = bufs["block_tables"]
    for i, row in enumerate(rows):
        seq = row[0]
        table = seq.block_table
        write_decode_row(bufs, i, row, block_size)
        h = held[i]
        done = h[2] if h is not None and h[:2] == (seq.request_id, seq.num_preemptions) else 0
        if done < len(table):
            tables[i, done:len(table)] = table[done:]
            held[i] = (seq.request_id, seq.num_preemptions, len(table))


class CapturedDecode:
    def __init__(self, model, kv_caches: list[torch.Tensor], capture_sizes: list[int],
                 max_blocks_per_seq: int, block_size: int, pad_slot: int, max_burst: int = 1,
                 page_map: PageMap | None = None):
        """pad_slot: a KV slot outside every page the block manager hands out;
        max_burst: the most steps of one burst; page_map: the sliding layers'
        pages where they have a pool of their own (layers/page_map.py)."""
        self.model, self.kv_caches, self.page_map = model, kv_caches, page_map
        self.sizes = sorted(set(capture_sizes))
        self.block_size, self.pad_slot = block_size, pad_slot
        n = self.sizes[-1]
        self.ids = torch.zeros(n, dtype=torch.long)
        self.positions = torch.zeros(n, dtype=torch.long)
        self.slots = torch.full((n,), pad_slot, dtype=torch.long)
        self.context_lens = torch.zeros(n, dtype=torch.long)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.long)
        # numpy views: writing a few ints into them costs far less than a torch op
        self._np = {k: getattr(self, k).numpy() for k in
                    ("ids", "positions", "slots", "context_lens", "block_tables")}
        self._rows: list[tuple | None] = [None] * n  # (request, preemptions, blocks written) per row
        self.graphs: dict[int, graph.StepGraph] = {}
        self.arena = Arena()  # every graph's intermediate buffers (they replay one at a time)
        self.heads: dict[int, graph.StepGraph] = {}  # per row count (module docstring)
        self.steps: dict[int, graph.StepGraph] = {}  # per row count: its decode graph, then its head
        self.step_seconds: dict[int, float] = {}  # per row count: its last step's replay (a burst's: per step)
        self.with_head = True  # False: the head could not be captured
        self.disabled: str | None = None
        self.capture_seconds = 0.0
        self.bursts = CapturedBursts(self, max_burst)  # decode bursts over these graphs

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def capture_all(self) -> None:
        """Capture every size now (largest first: the others share its buffers)."""
        start = time.perf_counter()
        for size in reversed(self.sizes):
            if self._graph(size) is None:
                break
        else:
            # the largest head first (the others share its buffers) and the one-row
            # head (_check_kernels replays it); the rest when a step first has that
            # many rows: a head records in milliseconds, and a server of 64
            # sequences would otherwise record 64 of them at every start
            if self._head(self.max_size) is not None:
                self._head(1)
            self._check_kernels()
        self.capture_seconds = time.perf_counter() - start
        if self.disabled is None:
            log.info("captured decode graphs for batch sizes %s in %.2f s", self.sizes, self.capture_seconds)

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(is_prefill=False, slot_mapping=self.slots[:size],
                                 block_tables=self.block_tables[:size], context_lens=self.context_lens[:size],
                                 num_decodes=size, window_pages=self.page_map)

    @torch.inference_mode()
    def _graph(self, size: int) -> graph.StepGraph | None:
        g = self.graphs.get(size)
        if g is not None or self.disabled:
            return g
        g = graph.StepGraph(self.graphs.get(self.max_size))
        self._reset_rows(0, self.max_size)
        try:
            g.capture(self.model, self.ids[:size], self.positions[:size], self._meta(size), self.kv_caches,
                      arena=self.arena)
        except graph.CaptureError as e:
            self.disabled = str(e)
            log.warning("decode steps run op by op (not captured): %s", e)
            return None
        self.graphs[size] = g
        return g

    @torch.inference_mode()
    def _head(self, rows: int) -> graph.StepGraph | None:
        """The LM head over the first `rows` hidden states of the decode graph
        they run in, or None where the head does not record."""
        g = self.heads.get(rows)
        if g is not None or not self.with_head:
            return g
        g = graph.StepGraph(self.heads.get(self.max_size))
        try:
            g.capture(self._logits_and_greedy, self.graphs[self.bucket(rows)].output[:rows], arena=self.arena)
        except graph.CaptureError as e:
            self._no_head(e)
            return None
        self.heads[rows] = g
        return g

    def _logits_and_greedy(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The head's logits and, where the C argmax takes them, each row's argmax."""
        logits = self.model.compute_logits(hidden)
        return logits, elementwise.argmax(logits) if elementwise.argmax_takes(logits) else None

    def _no_head(self, why: Exception) -> None:
        log.info("the LM head runs op by op after each captured decode step: %s", why)
        self.with_head = False
        self.heads.clear()
        self.steps.clear()
        self.bursts.clear()

    def _check_kernels(self) -> None:
        """Recording ran no kernel: replay the smallest graph once (padding rows
        only, writing nowhere), then the one-row head, so a kernel that refuses
        its arguments shows here, not in the first served step. What a kernel
        checks depends on the layer shapes, not on the batch size."""
        try:
            self.graphs[self.sizes[0]].replay()
        except RuntimeError as e:
            self.graphs.clear()
            self.disabled = str(e)
            log.warning("decode steps run op by op (not captured): %s", e)
            return
        try:
            if self.with_head:
                self.heads[1].replay()
        except RuntimeError as e:
            self._no_head(e)

    def _reset_rows(self, lo: int, hi: int) -> None:
        reset_decode_rows(self._np, self._rows, lo, hi, self.pad_slot)

    def bucket(self, batch_size: int) -> int | None:
        """The captured size a decode batch runs in, or None (op by op)."""
        return None if self.disabled else bucket_size(self.sizes, batch_size)

    def logits(self, decodes: list[Sequence], drafts: list[Row] = ()
               ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Logits [rows, vocab] of one decode step and each row's argmax
        (int64 [rows], or None where the step did not compute it), or None
        when this batch cannot run captured. Rows: one per decode, then one
        per draft (seq, position, token) of a speculative step, each
        attending to its sequence up to its own position."""
        b = len(decodes) + len(drafts)
        size = self.bucket(b)
        g = self._graph(size) if size is not None else None
        if g is None:
            return None
        self._write_inputs(decodes, drafts)
        if size > b:
            self._reset_rows(b, size)
        head = self._head(b)
        if head is None:
            return self.model.compute_logits(g.replay()[:b]), None
        start = time.perf_counter()
        out = self._step(b, g, head).replay()
        self.step_seconds[b] = time.perf_counter() - start
        return out

    def _step(self, b: int, g: graph.StepGraph, head: graph.StepGraph) -> graph.StepGraph:
        step = self.steps.get(b)
        if step is None:
            step = self.steps[b] = g.then(head)
        return step

    def _write_inputs(self, decodes: list[Sequence], drafts: list[Row] = ()) -> None:
        write_decode_inputs(self._np, self._rows, decode_rows(decodes, drafts), self.block_size)
