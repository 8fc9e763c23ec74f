"""Owns the model and the KV page pool; turns scheduled sequences into tensors."""
from __future__ import annotations

import dataclasses
import logging

import torch

from qoqserve.config import EngineConfig
from qoqserve.engine.backends import select_backends
from qoqserve.engine.captured_burst import BurstResult
from qoqserve.engine.captured_mixed import CapturedMixed
from qoqserve.engine.captured_step import CapturedDecode, default_capture_sizes
from qoqserve.engine.graphed_decode import GraphedDecode
from qoqserve.engine.kv_budget import pool_sizes
from qoqserve.engine.parallel_world import ParallelWorld
from qoqserve.engine.scheduler import ScheduledBatch
from qoqserve.engine.staging import HostStaging
from qoqserve.engine.step_inputs import StepInputs, sampled_rows, step_inputs
from qoqserve.kernels.cpu import prebuild
from qoqserve.kernels.cpu.one_shot import OneShotSteps
from qoqserve.layers.attention import AttentionMetadata
from qoqserve.layers.key_transform import share_equal_rotations
from qoqserve.layers.linear import Linear
from qoqserve.layers.page_map import PageMap
from qoqserve.layers.parallel import SINGLE
from qoqserve.layers.quantization import QuantizationConfig, UnquantizedConfig
from qoqserve.layers.sampler import Sampler, argmax_tokens
from qoqserve.models.arch import ModelArchConfig
from qoqserve.models.llama import LlamaForCausalLM, next_token_logprobs

log = logging.getLogger(__name__)

def resident_bytes(module: torch.nn.Module) -> int:
    """Bytes of every tensor the module keeps alive: its parameters and buffers
    (linear methods register what they derive as buffers), each storage once."""
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        if t.device.type == "meta":
            continue
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


class ModelRunner:
    def __init__(self, config: EngineConfig, arch: ModelArchConfig, tensors, max_positions: int,
                 quant: QuantizationConfig | None = None, world: ParallelWorld | None = None,
                 executor=None):
        """tensors: (name, tensor) pairs of the checkpoint (LazyTensors let a
        tensor-parallel rank read only its slices).
        quant: the checkpoint's scheme (ModelSource.quant_config; None: full precision).
        world: this rank of a tensor-parallel engine (None: one process);
        executor: on rank 0 of one, what broadcasts each step to the others."""
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.block_size = config.cache.block_size
        self.world, self.executor = world, executor
        tp = world.tp if world is not None else SINGLE
        # this rank's pages hold only the KV heads it computes
        _, local_kv = tp.kv_heads(arch.num_kv_heads, arch.num_heads)
        if self.device.type == "cpu" and config.kernels != "torch":
            prebuild.build_all()  # before the backends ask which kernels this CPU has
        self.backends = select_backends(config, dataclasses.replace(arch, num_kv_heads=local_kv),
                                        quant or UnquantizedConfig())
        self.attention = self.backends.attention
        self.layout = self.attention.layout
        with torch.device(self.device):
            self.model = LlamaForCausalLM(arch, self.attention, self.dtype,
                                          linear_method=self.backends.linear_method,
                                          max_positions=max_positions,
                                          key_transform=self.backends.quant.key_transform,
                                          logits_head=self.backends.logits_head,
                                          token_ops=self.backends.token_ops, tp=tp)
        self.model.load_weights(tensors)
        share_equal_rotations(self.model)  # not in load_weights: the quantizer fills each layer's R in place
        self.model.release_lm_head()
        self.model.eval()
        self.num_blocks, self.num_window_pages = self._pool_sizes(config, arch, max_positions, world)
        # one page more than the block manager hands out: padding rows of a
        # captured step write their K/V there
        # the layers the model gives the step through the page map (LlamaModel.slides) get the sliding pool
        own_pool = [s and self.num_window_pages is not None for s in self.model.slides]
        self.kv_caches = [self.layout.allocate((self.num_window_pages if own else self.num_blocks) + 1, self.device)
                          for own in own_pool]
        self.num_full_layers = own_pool.count(False)  # the layers that keep every page
        # the sliding layers' page of each block (none yet: their pad page)
        self.page_map = (PageMap(torch.full((self.num_blocks + 1,), self.num_window_pages, dtype=torch.long,
                                            device=self.device), self.block_size)
                         if self.num_window_pages is not None else None)
        self.page_updates = None  # what gives the page map's changes before each step (LLMEngine sets it)
        self.sampler = Sampler(config.seed)
        self.staging = HostStaging(self.device)
        self._log_load()
        self.captured: CapturedDecode | None = None  # CPU: recorded C calls
        self.graphed: GraphedDecode | None = None     # CUDA: CUDA graphs
        sizes = self._capture_sizes(config, world)
        width = -(-max_positions // self.block_size)
        if sizes and self.device.type == "cpu":
            self.captured = CapturedDecode(self.model, self.kv_caches, sizes, width, self.block_size,
                                           pad_slot=self.num_blocks * self.block_size,
                                           max_burst=config.scheduler.num_scheduler_steps, page_map=self.page_map)
            self.captured.capture_all()
            if self.captured.disabled:
                self.captured = None
        elif sizes:
            self.use_graphs(GraphedDecode(self.model, self.kv_caches, sizes, width, self.block_size,
                                          pad_slot=self.num_blocks * self.block_size, device=self.device,
                                          page_map=self.page_map))
        # steps with prefill chunks: captured per padded shape where decodes are
        self.mixed = (CapturedMixed(self.model, self.kv_caches, self.captured.sizes, config.scheduler.max_num_seqs,
                                    width, self.block_size, pad_slot=self.num_blocks * self.block_size,
                                    page_map=self.page_map)
                      if self.captured is not None else None)
        # eager steps (prefills, mixed batches) of the same kernels: planned and run back to back
        self.one_shot = OneShotSteps() if self.captured is not None else None

    def _pool_sizes(self, config: EngineConfig, arch: ModelArchConfig, max_positions: int,
                    world: ParallelWorld | None) -> tuple[int, int | None]:
        """(pages of the main pool, of the sliding layers' own pool or None):
        engine/kv_budget.py's, the same on every rank."""
        blocks, window = pool_sizes(config, self.layout, arch, self.device, max_positions)
        if world is not None:  # one block manager for all: the pools every rank can hold
            if not world.min_int(int(window is not None)) and window is not None:
                blocks, window = pool_sizes(dataclasses.replace(config, cache=dataclasses.replace(
                    config.cache, disable_hybrid_kv_cache_manager=True)), self.layout, arch, self.device,
                    max_positions)
            blocks = world.min_int(blocks)
            window = world.min_int(window) if window is not None else None  # every rank has one, or none
        return blocks, window

    def _capture_sizes(self, config: EngineConfig, world) -> list[int]:
        """The decode batch sizes captured (as C call lists on CPU, CUDA graphs
        on CUDA): none on other devices, with --enforce-eager or tensor
        parallelism (the all-reduces are not among what a step records), none
        past what the linears allow."""
        if self.device.type not in ("cpu", "cuda") or config.enforce_eager or world is not None:
            return []
        sizes = config.capture_size_list() or default_capture_sizes(config.scheduler.max_num_seqs)
        limits = [m.method.capture_rows(self.dtype) for m in self.model.modules() if isinstance(m, Linear)]
        most = min((n for n in limits if n is not None), default=None)  # larger batches run op by op
        return [s for s in sizes if most is None or s <= most]

    def use_graphs(self, graphed: GraphedDecode) -> None:
        """Run decode steps through `graphed` (captured here; if that fails,
        op by op)."""
        graphed.capture_all()
        self.graphed = graphed if not graphed.disabled else None

    def decode_graphs(self) -> CapturedDecode | GraphedDecode | None:
        """What decode steps replay from, if anything."""
        return self.captured if self.captured is not None else self.graphed

    def _log_load(self) -> None:
        paths: dict[str, int] = {}
        for m in self.model.modules():
            if isinstance(m, Linear):
                paths[m.method.describe(m)] = paths.get(m.method.describe(m), 0) + 1
        linears = [m for m in self.model.modules() if isinstance(m, Linear)]
        log.info("linear kernel paths: %s; linear weights %.1f MiB resident, model %.1f MiB",
                 ", ".join(f"{p} x{n}" for p, n in paths.items()),
                 sum(resident_bytes(m) for m in linears) / 2**20, resident_bytes(self.model) / 2**20)
        log.info("KV cache: %d pages x %d tokens, %s (%s kernels), %d bytes/token/layer",
                 self.num_blocks, self.block_size, self.layout.name, self.attention.name,
                 self.layout.bytes_per_token())
        if self.num_window_pages is not None:
            log.info("the %d sliding-window layers' K/V: a pool of their own of %d pages (the main one "
                     "holds the other %d layers')", len(self.kv_caches) - self.num_full_layers,
                     self.num_window_pages, self.num_full_layers)

    def stats(self) -> dict:
        paths = sorted({m.method.describe(m) for m in self.model.modules() if isinstance(m, Linear)})
        graphs = self.decode_graphs()
        return {"tensor_parallel_size": self.world.size if self.world is not None else 1,
                "weight_bytes": resident_bytes(self.model),
                "linear_weight_bytes": sum(resident_bytes(m) for m in self.model.modules()
                                           if isinstance(m, Linear)),
                "kv_layout": self.layout.name, "kv_kernel": self.attention.name,
                "lm_head_kernel": self.backends.logits_head.name,
                "lm_head_copy_bytes": self.backends.logits_head.resident_bytes(),
                "lm_head_read_bytes": self.backends.logits_head.read_bytes(self.model.lm_head),
                "token_ops": self.backends.token_ops.name,
                # of the layers that keep every page (all but the sliding ones where those have a pool),
                # and of those with a pool of their own (engine/window_pages.py), which hold a window's
                "kv_bytes_per_token": self.layout.bytes_per_token() * self.num_full_layers,
                "window_kv_bytes_per_token": self.layout.bytes_per_token() * (len(self.kv_caches)
                                                                              - self.num_full_layers),
                "sliding_window": self.model.cfg.sliding_window,
                "num_kv_blocks": self.num_blocks, "block_size": self.block_size,
                "num_window_kv_blocks": self.num_window_pages,
                "linear_paths": paths, "dtype": str(self.dtype).replace("torch.", ""),
                "captured_decode_sizes": graphs.sizes if graphs is not None else [],
                # eager steps recorded and run back to back (one_shot.py; a kind that cannot be is logged)
                "one_shot_eager_steps": self.one_shot is not None}

    def _tensors(self, step: StepInputs):
        put = self.staging.put
        width = max(len(t) for t in step.block_tables)
        tables = put("block_tables", [b for t in step.block_tables for b in t + [0] * (width - len(t))],
                     (len(step.block_tables), width))
        meta = AttentionMetadata(
            is_prefill=step.query_starts is not None, slot_mapping=put("slots", step.slots),
            block_tables=tables,
            context_lens=put("context_lens", step.context_lens) if step.context_lens else None,
            query_starts=step.query_starts, cached_lens=step.cached_lens,
            num_decodes=len(step.context_lens), window_pages=self.page_map)
        return put("ids", step.ids), put("positions", step.positions), meta

    def map_pages(self, updates: list[tuple[int, int]]) -> None:
        """(block id, page of the sliding layers' pool) pairs into the page map."""
        blocks, pages = zip(*updates)
        self.page_map.pages[torch.tensor(blocks, device=self.device)] = torch.tensor(pages, device=self.device)

    def _sync_pages(self) -> None:
        """The block manager's changes to the page map since the last step, on
        every rank, before a forward reads it."""
        updates = self.page_updates() if self.page_updates is not None else None
        if updates:
            if self.executor is not None:
                self.executor.send(("pages", updates))
            self.map_pages(updates)

    @torch.inference_mode()
    def execute(self, step: StepInputs) -> torch.Tensor:
        """The forward of one step on this rank: hidden states of the sampled rows.
        On rank 0 of a tensor-parallel engine the step goes to the workers first,
        and a failure inside the forward ends the engine (the ranks may be
        mid-collective: WorkerFailedError)."""
        if self.executor is not None:
            self.executor.send(("step", step))
        try:
            ids, positions, meta = self._tensors(step)
            hidden = (self.model(ids, positions, meta, self.kv_caches) if self.one_shot is None
                      else self.one_shot(self.model, ids, positions, meta, self.kv_caches,
                                         kind="mixed" if meta.num_decodes else "prefill", rows=ids.shape[0]))
        except Exception as e:
            if self.executor is not None:
                raise self.executor.failure(e) from e
            raise
        if len(step.rows) != hidden.shape[0]:
            hidden = hidden[self.staging.put("sample_rows", step.rows)]
        return hidden

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch):
        """One forward step; returns the sampler's (tokens, logprobs, top_logprobs)
        for batch.sampled (nothing to sample when every chunk is partial).
        Re-running a step that failed (after rollback()) is safe: it writes the
        same K/V to the same slots, and the seeded generators draw again from
        where they were."""
        self.sampler.begin()
        self._sync_pages()
        graphs = self.decode_graphs()
        if not batch.prefills and graphs is not None:
            out = graphs.logits(batch.decodes)
            if out is not None:
                return self.sampler(out[0], batch.sampled, greedy=out[1])
        if batch.prefills and self.mixed is not None:
            rows = sampled_rows(batch)
            hidden = self.mixed.run(batch, rows)
            if hidden is not None:
                return self.sampler(self.model.compute_logits(hidden), batch.sampled) if rows else ([], None, None)
        step = step_inputs(batch, self.block_size)
        hidden = self.execute(step)
        if not step.rows:
            return [], None, None
        return self.sampler(self.model.compute_logits(hidden), batch.sampled)

    @torch.inference_mode()
    def run_verify(self, batch: ScheduledBatch, drafts: list[list[int]]):
        """A decode step that also scores draft tokens (engine/speculative.py):
        the sampler's (tokens, logprobs, top_logprobs) for batch.decodes, as
        run() gives them, and each decode's (token, logprob, top pairs) after its
        drafts: the argmax after each (plain greedy rows: no logprobs), or the
        sampler's choice after each as long as the token before it equals it
        (Sampler.after_drafts). Each draft is a row of its own (its
        token at its position, attending up to it), so every row's logits are
        those a one-token step there would compute."""
        self.sampler.begin()
        self._sync_pages()
        rows = [(seq, len(seq) + j, t) for seq, d in zip(batch.decodes, drafts) for j, t in enumerate(d)]
        b = len(batch.decodes)
        graphs = self.decode_graphs()
        out = graphs.logits(batch.decodes, rows) if graphs is not None else None
        if out is None:
            out = self.model.compute_logits(self.execute(step_inputs(batch, self.block_size, rows))), None
        logits, greedy = out
        sampled = self.sampler(logits[:b], batch.sampled, greedy=greedy[:b] if greedy is not None else None)
        after = (greedy[b:] if greedy is not None else argmax_tokens(logits[b:].float())).tolist()
        per_seq, at = [], 0
        for seq, t0, d in zip(batch.decodes, sampled[0], drafts):
            per_seq.append([(t, None, None) for t in after[at:at + len(d)]] if seq.takes_argmax
                           else self.sampler.after_drafts(logits[b + at:b + at + len(d)], seq, t0, d))
            at += len(d)
        return sampled, per_seq

    def run_burst(self, batch: ScheduledBatch, n: int) -> BurstResult | None:
        """n decode steps of batch's decodes at once (engine/burst.py): their
        tokens [n][rows] (and logprobs, where a row asks), or None where the
        batch cannot run so. Sampled rows take their n uniforms up front; a
        burst that does not run gives them back."""
        if self.captured is None or batch.prefills:
            return None
        self._sync_pages()
        return self.captured.bursts.run_sequences(batch.decodes, n, self.sampler)

    def step_seconds(self, rows: int) -> float | None:
        """The last captured decode step of this many rows took (None: none yet,
        or steps that cannot run in bursts: only CPU captured steps do)."""
        return self.captured.step_seconds.get(rows) if self.captured is not None else None

    def rollback(self) -> None:
        """The last run() failed: undo what its sampling drew."""
        self.sampler.rollback()

    def release(self, request_id: str) -> None:
        """A request ended: drop its sampling state."""
        self.sampler.release(request_id)

    def prompt_logprobs(self, token_ids: list[int], pages: list[int] | None = None) -> torch.Tensor:
        """Scored pass (perplexity); pages: free pages to write K/V into, so
        attention runs the paged prefill kernel (else an uncached pass)."""
        return next_token_logprobs(self.prompt_logits(token_ids, None, pages), token_ids)

    def prompt_logits(self, token_ids: list[int], rows: list[int] | None,
                      pages: list[int] | None = None) -> torch.Tensor:
        """Scored pass returning next-token logits at rows (all rows: None), in
        fp32 (quality metrics); workers run the same pass for their shards."""
        self._sync_pages()
        if self.executor is not None:
            self.executor.send(("logits", token_ids, rows, pages))
        try:
            return self.model.prompt_logits(token_ids, rows, pages, self.kv_caches, self.block_size, self.page_map)
        except Exception as e:
            if self.executor is not None:
                raise self.executor.failure(e) from e
            raise
