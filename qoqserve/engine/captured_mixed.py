"""Steps with prefill chunks (a prompt alone, or chunks beside running decodes)
replayed from captured graphs on CPU, as decode steps are (captured_step.py).

A step of fewer than one_shot.MIN_ROWS rows runs op by op, and its Python
(~5 ms for the embedded model, ~270 kernel calls) is as long as the kernels
of a short prompt's chunk beside 32 decodes. Such a step's shape is: d
decodes, then s prefill chunks of t tokens in all. Padded to d_b (the next
captured decode size), t_b (the next multiple of ROW_QUANTUM), s_b chunks
(the next power of two: the added ones are empty) and one more sequence
holding the t_b - t padding rows, every step of the same (d_b, t_b, s_b)
makes the same kernel calls; only the inputs change, and they
are read from buffers owned here. A shape is recorded (graph.StepGraph's
rules: no torch op may compute) the second time it is seen, its buffers are
placed in one arena shared by every mixed graph (buffer_plan.relocate: only one
runs at a time), and later steps of that shape write their inputs and replay
the calls from C.

Padding writes nowhere and changes no real row: padding decodes have context
length 0 (their output is zeros) and the pad slot; the padding sequence's
rows write the pad slot and attend over the pad page only, in a sequence of
their own; every kernel computes each row (attention: each sequence) on its
own, so the real rows get the bits the op-by-op step gives (tests check it).
A pointer argument into memory the graph does not own (a tensor made from
this step's values while recording would be frozen into every replay) makes
the capture fail, and that step shape runs op by op, as logged.
"""
from __future__ import annotations

import bisect
import collections
import logging
import math

import numpy as np
import torch

from qoqserve.engine.captured_step import pad_decode_rows, write_decode_row
from qoqserve.engine.scheduler import ScheduledBatch
from qoqserve.engine.step_inputs import decode_rows
from qoqserve.kernels.cpu import graph
from qoqserve.kernels.cpu.buffer_plan import Arena, relocate, storage_spans
from qoqserve.kernels.cpu.one_shot import MIN_ROWS
from qoqserve.kernels.cpu.replay import NativePlan, arg_code
from qoqserve.layers.attention import AttentionMetadata
from qoqserve.layers.page_map import PageMap

log = logging.getLogger(__name__)

ROW_QUANTUM = 16     # prefill rows are padded to a multiple of this
CAPTURE_AFTER = 1    # a shape seen this many times before is captured
MAX_GRAPHS = 64      # least recently used graphs beyond this are dropped


class _MixedGraph:
    def __init__(self, plan: NativePlan, output: torch.Tensor, arena_block: torch.Tensor):
        self.plan, self.output = plan, output
        self._block = arena_block  # the calls hold addresses in it

    def replay(self) -> torch.Tensor:
        self.plan.run()
        return self.output


class CapturedMixed:
    def __init__(self, model, kv_caches: list[torch.Tensor], decode_sizes: list[int], max_seqs: int,
                 max_blocks_per_seq: int, block_size: int, pad_slot: int, page_map: PageMap | None = None):
        """decode_sizes: the sizes decode rows are padded to (the captured
        decode sizes); pad_slot: the first slot of a page no sequence owns;
        page_map: as CapturedDecode's."""
        self.model, self.kv_caches, self.page_map = model, kv_caches, page_map
        self.decode_sizes = sorted(set(decode_sizes))
        self.block_size, self.pad_slot = block_size, pad_slot
        rows, seqs = MIN_ROWS, self.decode_sizes[-1] + max_seqs + 1
        self.ids = torch.zeros(rows, dtype=torch.long)
        self.positions = torch.zeros(rows, dtype=torch.long)
        self.slots = torch.full((rows,), pad_slot, dtype=torch.long)
        self.context_lens = torch.zeros(self.decode_sizes[-1], dtype=torch.long)
        self.block_tables = torch.full((seqs, max_blocks_per_seq), pad_slot // block_size, dtype=torch.long)
        self.query_starts = torch.zeros(max_seqs + 2, dtype=torch.long)
        self.first_positions = torch.zeros(max_seqs + 1, dtype=torch.long)
        self._np = {k: getattr(self, k).numpy() for k in
                    ("ids", "positions", "slots", "context_lens", "block_tables", "query_starts",
                     "first_positions")}
        self.graphs: collections.OrderedDict[tuple, _MixedGraph] = collections.OrderedDict()
        self.seen: collections.Counter = collections.Counter()
        self.failed: dict[tuple, str] = {}
        self.replays: collections.Counter = collections.Counter()
        self.arena = Arena()
        self._static_spans: set | None = None

    def shape(self, batch: ScheduledBatch) -> tuple[int, int, int] | None:
        """(d_b, t_b, s_b) of a step with prefill chunks, or None: it runs op by op."""
        d, t = len(batch.decodes), sum(n for _, n in batch.prefills)
        if d > self.decode_sizes[-1]:
            return None
        d_b = self.decode_sizes[bisect.bisect_left(self.decode_sizes, d)] if d else 0
        t_b = -(-t // ROW_QUANTUM) * ROW_QUANTUM
        s_b = 1 << (len(batch.prefills) - 1).bit_length()  # 1, 2, 4, ...: the rest are empty
        if d_b + t_b > MIN_ROWS or s_b + 1 > self.first_positions.numel():
            return None
        return d_b, t_b, s_b

    def run(self, batch: ScheduledBatch, rows: list[int]) -> torch.Tensor | None:
        """Final hidden states at `rows` (indices as the op-by-op step numbers
        them: decodes, then the chunks' tokens) of this step, or None when it
        runs op by op."""
        key = self.shape(batch)
        if key is None or key in self.failed:
            return None
        g = self.graphs.get(key)
        if g is None:
            self.seen[key] += 1
            if self.seen[key] <= CAPTURE_AFTER:
                return None
        self._write_inputs(batch, key)  # before a capture too: its Python may check them
        if g is None:
            g = self._capture(key)
            if g is None:
                return None
        self.graphs.move_to_end(key)
        self.replays[key] += 1
        hidden = g.replay()
        d, d_b = len(batch.decodes), key[0]
        return hidden[[r if r < d else r - d + d_b for r in rows]]

    def _meta(self, key) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        d_b, t_b, s = key
        n = d_b + t_b
        meta = AttentionMetadata(is_prefill=True, slot_mapping=self.slots[:n],
                                 block_tables=self.block_tables[:d_b + s + 1],
                                 context_lens=self.context_lens[:d_b] if d_b else None,
                                 query_starts=self.query_starts[:s + 2], cached_lens=self.first_positions[:s + 1],
                                 num_decodes=d_b, window_pages=self.page_map)
        return self.ids[:n], self.positions[:n], meta

    @torch.inference_mode()
    def _capture(self, key) -> _MixedGraph | None:
        d_b, t_b, s = key
        g = graph.StepGraph()
        g.kept = []
        try:
            out = g.record(self.model, *self._meta(key), self.kv_caches)
            self._check_pointers(g)
            ops = relocate(g, out, self.arena)
            plan = NativePlan(ops)
        except (graph.CaptureError, ValueError, RuntimeError, MemoryError) as e:
            self.failed[key] = str(e)
            log.info("steps of %d decodes and %d prefill rows in %d chunks run op by op: %s", d_b, t_b, s, e)
            return None
        self.graphs[key] = _MixedGraph(plan, out, self.arena.block)
        if len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)
        return self.graphs[key]

    def _check_pointers(self, g: graph.StepGraph) -> None:
        """Every pointer a call gets is into the graph's own buffers, its input
        buffers, the model's tensors or the KV pages: a tensor made during the
        recording from this step's values would be replayed unchanged."""
        if self._static_spans is None:  # the model's tensors, the pages and the inputs do not move
            self._static_spans = storage_spans((*(getattr(self, k) for k in self._np), *self.kv_caches,
                                         *self.model.parameters(), *self.model.buffers(),
                                         *_module_tensors(self.model)))
        spans = sorted(self._static_spans | storage_spans(g.buffers))
        starts = [a for a, _ in spans]
        for fn, args in g.ops:
            for t, v in zip(fn.argtypes, args):
                if arg_code(t) != "p" or not isinstance(v, int) or v == 0:
                    continue
                i = bisect.bisect_right(starts, v) - 1
                if i < 0 or v >= spans[i][0] + spans[i][1]:
                    raise graph.CaptureError(f"{fn.__name__} reads memory made while recording")

    def _write_inputs(self, batch: ScheduledBatch, key) -> None:
        np_, bs = self._np, self.block_size
        d_b, t_b, s = key
        d = len(batch.decodes)
        for i, row in enumerate(decode_rows(batch.decodes)):
            write_decode_row(np_, i, row, bs)
            table = row[0].block_table
            np_["block_tables"][i, :len(table)] = table
        pad_decode_rows(np_, d, d_b, self.pad_slot)
        at = d_b
        starts, first = np_["query_starts"], np_["first_positions"]
        starts[0] = 0
        for j, (seq, n) in enumerate(batch.prefills):
            start = seq.num_computed_tokens
            pos = np.arange(start, start + n)
            table = np.asarray(seq.block_table, dtype=np.int64)
            np_["ids"][at:at + n] = seq.token_ids[start:start + n]
            np_["positions"][at:at + n] = pos
            np_["slots"][at:at + n] = table[pos // bs] * bs + pos % bs
            np_["block_tables"][d_b + j, :len(table)] = table
            first[j] = start
            at += n
            starts[j + 1] = at - d_b
        for j in range(len(batch.prefills), s):  # empty sequences up to the captured count
            first[j] = 0
            starts[j + 1] = at - d_b
        # the padding sequence: rows at..d_b+t_b, positions from 0 over the pad page
        pad = d_b + t_b - at
        np_["ids"][at:at + pad] = 0
        np_["positions"][at:at + pad] = np.arange(pad)
        np_["slots"][at:at + pad] = self.pad_slot
        np_["block_tables"][d_b + s, :math.ceil(max(pad, 1) / bs)] = self.pad_slot // bs
        first[s] = 0
        starts[s + 1] = t_b


def _module_tensors(model) -> list[torch.Tensor]:
    """Tensors modules hold as plain attributes (kernel-ready weight copies)."""
    out = []
    for m in model.modules():
        for v in vars(m).values():
            if isinstance(v, torch.Tensor):
                out.append(v)
    return out
