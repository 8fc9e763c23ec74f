"""Decode steps replayed as CUDA graphs, one per batch-size bucket: the GPU
counterpart of captured_step.py's recorded C calls.

A decode step of B sequences launches the same kernels every time; only its
inputs change. So for each size in `capture_sizes` the model's forward is
captured once into a CUDA graph whose inputs are static device tensors
owned here (token ids, positions, slots, context lengths, block tables) and
whose output (the hidden states) stays where the capture left it. The LM
head and each row's argmax run after the replay, over the real rows only:
two launches, and no logits buffer per graph (at a 128k vocabulary the
captured logits of every size would take gigabytes of the pool). A step writes its rows into pinned host
buffers (block tables incrementally), copies them into the static tensors
with non_blocking copies on the stream, and replays: no per-kernel launch
from Python. A batch between two sizes runs in the next larger graph; its
padding rows read token 0 at position 0, write their K/V into a scratch page
no sequence owns and attend to nothing (context length 0), as on CPU.

What makes a forward capturable is that nothing in it reads the device
from the host: the Triton decode attention picks its context splits from
the block table's width, which is fixed (kernels/triton/paged_decode.py).
Sampling stays the sampler's: greedy rows take the argmax made on the
device (only token ids come back to the host), drawn rows sample from the
logits on the device. A capture that fails leaves the engine running op by op, and says
so once; `enforce_eager` never captures.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from qoqserve.engine.captured_step import bucket_size, reset_decode_rows, write_decode_inputs
from qoqserve.engine.sequence import Sequence
from qoqserve.engine.step_inputs import Row, decode_rows
from qoqserve.layers.attention import AttentionMetadata
from qoqserve.layers.page_map import PageMap
from qoqserve.layers.sampler import argmax_tokens

log = logging.getLogger(__name__)

INPUTS = ("ids", "positions", "slots", "context_lens", "block_tables")


class CudaGraphs:
    """Capture and replay through torch.cuda.CUDAGraph, every graph in one
    memory pool (they replay one at a time, so their intermediates can share
    it)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        # warm-up off the capture: Triton compiles, cuBLAS picks its kernels and
        # workspaces, the caching allocator sees the sizes
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        self.pool = graph.pool()
        return graph.replay, out


class EagerGraphs:
    """The same contract run eagerly: replay runs the forward again on the
    static inputs and writes its result into the captured output. For
    devices without graphs, and for testing GraphedDecode's bookkeeping (the
    static buffers, padding, incremental block tables) where CUDA is not."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        out = fn()
        return lambda: out.copy_(fn()), out


class GraphedDecode:
    def __init__(self, model, kv_caches: list[torch.Tensor], capture_sizes: list[int], max_blocks_per_seq: int,
                 block_size: int, pad_slot: int, device: torch.device, graphs=None,
                 page_map: PageMap | None = None):
        """pad_slot: a KV slot outside every page the block manager hands out;
        graphs: CudaGraphs (the default) or EagerGraphs; page_map: the sliding
        layers' pages where they have a pool of their own (layers/page_map.py)."""
        self.model, self.kv_caches, self.device, self.page_map = model, kv_caches, device, page_map
        self.sizes = sorted(set(capture_sizes))
        self.block_size, self.pad_slot = block_size, pad_slot
        self.graphs = graphs if graphs is not None else CudaGraphs(device)
        n, pinned = self.sizes[-1], device.type == "cuda"
        shapes = {"block_tables": (n, max_blocks_per_seq)}
        self.host = {k: torch.zeros(shapes.get(k, (n,)), dtype=torch.long, pin_memory=pinned) for k in INPUTS}
        self._np = {k: v.numpy() for k, v in self.host.items()}  # a few ints written per step
        # copies even on the host's own device: the graphs read only these
        self.static = {k: v.to(device, copy=True) for k, v in self.host.items()}
        self._held: list[tuple | None] = [None] * n  # what each row's block table holds (write_decode_inputs)
        self.replays: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}  # size: (replay, hidden)
        self.disabled: str | None = None
        self.capture_seconds = 0.0

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every size now, largest first; on a failure none is used."""
        start = time.perf_counter()
        # every row padding while capturing: the forwards write only the scratch page
        reset_decode_rows(self._np, self._held, 0, self.max_size, self.pad_slot)
        self._upload(self.max_size)
        for size in reversed(self.sizes):
            try:
                self.replays[size] = self.graphs.capture(lambda size=size: self._forward(size))
            except Exception as e:  # anything the capture cannot hold: run op by op instead
                self.replays.clear()
                self.disabled = f"{type(e).__name__}: {e}"
                log.warning("decode steps run op by op (no graph captured): %s", self.disabled)
                return
        self.capture_seconds = time.perf_counter() - start
        log.info("captured decode graphs for batch sizes %s in %.2f s", self.sizes, self.capture_seconds)

    def _forward(self, size: int) -> torch.Tensor:
        s = self.static
        meta = AttentionMetadata(is_prefill=False, slot_mapping=s["slots"][:size],
                                 block_tables=s["block_tables"][:size], context_lens=s["context_lens"][:size],
                                 num_decodes=size, window_pages=self.page_map)
        return self.model(s["ids"][:size], s["positions"][:size], meta, self.kv_caches)

    def _upload(self, rows: int) -> None:
        """The first `rows` rows of every input to the static tensors, queued on
        the stream before the replay that reads them."""
        for k in INPUTS:
            self.static[k][:rows].copy_(self.host[k][:rows], non_blocking=True)

    def bucket(self, batch_size: int) -> int | None:
        """The captured size a decode batch runs in, or None (op by op)."""
        return None if self.disabled or not self.replays else bucket_size(self.sizes, batch_size)

    def logits(self, decodes: list[Sequence], drafts: list[Row] = ()) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(logits [rows, vocab], argmax [rows]) of one decode step, or None when
        this batch cannot run in a graph. Rows as CapturedDecode.logits: one per
        decode, then one per draft of a speculative step."""
        b = len(decodes) + len(drafts)
        size = self.bucket(b)
        if size is None:
            return None
        # the host buffers are free again: the last step's copies were done by
        # the time its sampler's .tolist() returned (as engine/staging.py's)
        write_decode_inputs(self._np, self._held, decode_rows(decodes, drafts), self.block_size)
        if size > b:
            reset_decode_rows(self._np, self._held, b, size, self.pad_slot)
        self._upload(size)
        replay, hidden = self.replays[size]
        replay()
        logits = self.model.compute_logits(hidden[:b])
        return logits, argmax_tokens(logits)
