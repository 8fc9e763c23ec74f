"""The sliding layers' own page pool where a model mixes sliding and full
attention (engine/window_pages.py, vLLM's hybrid KV-cache manager): which
pages a sequence holds while it runs, prefix hits through it, the page map
the model reads it by, and engines over it against transformers and against
one pool for every layer, down to a pool so short that sequences queue for it."""
import dataclasses

import pytest
import torch
from test_block_manager import seq, step
from test_gemma3 import saved, tiny_gemma3

from qoqserve.config import SchedulerConfig
from qoqserve.engine import kv_budget
from qoqserve.engine.block_manager import BlockManager
from qoqserve.engine.scheduler import Scheduler
from qoqserve.engine.window_pages import (
    KEY_TILE,
    OutOfWindowPagesError,
    WindowPages,
    window_pool_size,
    window_span_blocks,
)
from qoqserve.kernels.cpu import page_map as c_page_map
from qoqserve.layers.attention import AttentionMetadata
from qoqserve.layers.page_map import PageMap
from qoqserve.llm import LLM
from qoqserve.sampling_params import SamplingParams

BS, WINDOW = 16, 20


def hybrid(num_blocks=64, pages=32, window=WINDOW, prefix=True):
    return BlockManager(num_blocks, BS, prefix, window=window, window_pages=WindowPages(pages))


def held_pages(bm, s) -> list[int]:
    """The indices of s's blocks whose sliding-layer page s holds."""
    wp = bm.window_pages
    return [i for i, b in enumerate(s.block_table)
            if b in wp.page_of and wp.refs[wp.page_of[b]] > 0 and s.num_released_blocks <= i < s.num_window_blocks]


def test_a_sequence_keeps_its_blocks_and_holds_window_pages_only_where_read():
    bm = hybrid()
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), bm, max_model_len=1024)
    a = seq("a", range(100))
    sched.add(a)
    while a.is_prefilling or len(a) < 400:  # chunks of 64, then decodes
        step(sched, sched.schedule())
        # every block kept; the sliding layers' pages from the window of its next
        # query on, and a block before (a hit ending at its last block boundary reads it)
        assert all(bm.blocks[b].ref_count == 1 for b in a.block_table)
        first = max(0, (a.num_computed_tokens - BS - WINDOW + 1 - KEY_TILE) // BS)
        assert a.num_released_blocks == first
        assert held_pages(bm, a) == list(range(first, -(-a.num_computed_tokens // BS)))
        assert len(held_pages(bm, a)) <= window_span_blocks(WINDOW, BS)
        pages = [bm.window_pages.page_of[a.block_table[i]] for i in held_pages(bm, a)]
        assert len(set(pages)) == len(pages)
    assert bm.num_free_blocks == 64 - len(a.block_table)
    sched.finish(a, "stop")
    assert bm.num_free_blocks == 64 and bm.window_pages.num_free == 32 and not any(bm.window_pages.refs)


def test_a_long_prompt_takes_window_pages_for_its_chunks_not_all_at_once():
    bm = hybrid(num_blocks=80, pages=12)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256), bm, max_model_len=2048)
    a = seq("a", range(1000))  # 63 blocks, in a pool of 12 window pages
    sched.add(a)
    chunks = []
    while a.is_prefilling:
        batch = sched.schedule()
        chunks.append(batch.prefills[0][1])
        step(sched, batch)
    # each chunk as far as 12 pages reach past the window before it
    assert max(chunks) < 256 and sum(chunks) == 1000 and sched.num_preemptions == 0
    assert len(held_pages(bm, a)) <= window_span_blocks(WINDOW, BS)


def test_prefix_hits_reach_as_far_as_the_window_pages_before_them_last():
    bm = hybrid(pages=16)
    a = seq("a", range(150))
    bm.allocate(a)
    for n in range(BS, 151, BS):  # a block at a time: the window moves past the early pages
        bm.fit_chunk(a, min(BS, 150 - a.num_computed_tokens))
        a.num_computed_tokens = n
        bm.on_tokens_computed(a)
    bm.deallocate(a)
    # its blocks and the window pages of the last ones are still tied: a whole hit
    b = seq("b", range(150))
    bm.allocate(b)
    assert b.num_cached_tokens == 144 and b.num_released_blocks == (144 - WINDOW + 1 - KEY_TILE) // BS
    assert held_pages(bm, b) == list(range(b.num_released_blocks, 9))
    bm.deallocate(b)
    # another sequence takes every window page: the blocks still hit, but
    # without their window's pages only as far as none is needed
    c = seq("c", range(1000, 1000 + 16 * BS))
    bm.allocate(c)
    assert bm.fit_chunk(c, 16 * BS) == 16 * BS and bm.window_pages.num_free == 0
    bm.deallocate(c)
    d = seq("d", range(150))
    bm.allocate(d)
    assert d.num_cached_tokens == 0
    updates = dict(bm.window_pages.take_updates())
    assert all(updates[blk] == bm.window_pages.pad_page for blk in a.block_table[:9] if blk not in c.block_table)


def test_prompts_run_one_after_another_are_hit_again_whole():
    # each prompt's prefill passes its early blocks' window pages (lent again
    # first) and ends holding its last window's, which outlive the later
    # prompts' chunks in a pool sized as the engine sizes it (as many finished
    # sequences' last windows kept as can run)
    pages = window_pool_size(WINDOW, BS, max_num_seqs=2, max_num_batched_tokens=200, lookahead=8, max_len=2048)
    bm = hybrid(num_blocks=200, pages=pages)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=200), bm, max_model_len=2048)
    prompts = [list(range(1000 * i, 1000 * i + 200)) for i in range(4)]

    def run_all() -> int:
        hits = bm.prefix_hits
        for i, p in enumerate(prompts):
            sched.add(seq(f"{i}", p))
        while sched.has_unfinished():
            for s in step(sched, sched.schedule()):
                sched.finish(s, "length")  # one token each
        return bm.prefix_hits - hits
    assert run_all() == 0
    assert run_all() == len(prompts) * (199 // BS * BS)


def test_a_page_let_go_stays_tied_to_its_block_until_lent_again():
    wp = WindowPages(2)
    wp.hold(5)
    page = wp.page_of[5]
    wp.drop(5)
    assert wp.has_page(5) and wp.num_free == 2  # a later hit on block 5 can use it
    wp.hold(6)
    wp.hold(7)  # the last free page: 5's
    assert wp.page_of[7] == page and not wp.has_page(5)
    assert dict(wp.take_updates()) == {5: wp.pad_page, 6: 1 - page, 7: page} and wp.take_updates() == []
    with pytest.raises(OutOfWindowPagesError):
        wp.hold(8)


def test_prompts_that_wait_for_each_others_window_pages_do_not_stall():
    # two prompts prefilled side by side, 32 tokens each a step, each holding
    # its window's pages: 10 are not enough for both to go on
    bm = hybrid(num_blocks=80, pages=10)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, long_prefill_token_threshold=32),
                      bm, max_model_len=2048)
    a, b = seq("a", range(400)), seq("b", range(1000, 1400))
    sched.add(a)
    sched.add(b)
    for _ in range(200):
        batch = sched.schedule()
        assert batch, "no step scheduled while prompts wait"
        step(sched, batch)
        if not a.is_prefilling and a in sched.running:
            sched.finish(a, "stop")
        if not sched.running and not sched.waiting or (a.status.name == "FINISHED" and not b.is_prefilling):
            break
    assert not b.is_prefilling and sched.num_preemptions > 0


@pytest.mark.parametrize("c", [True, False])
def test_a_step_through_the_page_map_in_c_and_in_torch(c, monkeypatch):
    if not c:  # as on CUDA
        monkeypatch.setattr(c_page_map, "available", lambda: False)
    pages = torch.randint(0, 50, (41,))
    meta = AttentionMetadata(True, torch.randint(0, 41 * BS, (37,)), torch.randint(0, 41, (5, 9)), None)
    assert meta.in_window_pages() is meta
    got = dataclasses.replace(meta, window_pages=PageMap(pages, BS)).in_window_pages()
    assert got.window_pages is None and got.query_starts is meta.query_starts
    assert torch.equal(got.block_tables, torch.stack([torch.stack([pages[b] for b in row])
                                                      for row in meta.block_tables]))
    assert torch.equal(got.slot_mapping, torch.stack([pages[s // BS] * BS + s % BS for s in meta.slot_mapping]))


# engines over the tiny Gemma 3 (5 sliding layers of window 16 to a global one)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    ref = tiny_gemma3()
    return ref, saved(ref, tmp_path_factory.mktemp("gemma3"))


PROMPTS = [torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (40, 100, 7, 150)]
GREEDY = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
SMALL = dict(dtype="float32", num_blocks=96, max_num_seqs=4, max_num_batched_tokens=32)


def transformers_greedy(ref, prompt, out) -> bool:
    with torch.inference_mode():
        logits = ref(torch.tensor([prompt + out])).logits[0]
    return logits[len(prompt) - 1:-1].argmax(-1).tolist() == out


def all_back(llm) -> bool:
    bm = llm.engine.block_manager
    return bm.num_free_blocks == bm.num_blocks and bm.window_pages.num_free == bm.window_pages.num_pages


def test_the_engine_over_a_window_pool_decodes_what_transformers_predicts(gemma3):
    ref, path = gemma3
    llm = LLM(path, **SMALL)
    runner = llm.engine.runner
    assert runner.captured is not None and runner.num_window_pages < runner.num_blocks
    sliding = [i for i in range(6) if i % 6 != 5]
    assert all(runner.kv_caches[i].shape[1] == (runner.num_window_pages if i in sliding else runner.num_blocks) + 1
               for i in range(6))
    # chunks of 32 past the window, mixed steps, captured decodes and bursts
    outs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert all(transformers_greedy(ref, p, o) for p, o in zip(PROMPTS, outs))
    assert all_back(llm) and llm.engine.num_bursts > 0
    # again: prefix hits, through the window pages still tied
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == outs
    assert llm.engine.block_manager.prefix_hits > 0 and all_back(llm)
    # a scored pass on scratch pages of both pools
    with torch.inference_mode():
        logits = ref(torch.tensor([PROMPTS[3]])).logits[0]
    want = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(PROMPTS[3][1:])[:, None])[:, 0]
    torch.testing.assert_close(llm.engine.prompt_logprobs(PROMPTS[3]), want, atol=1e-4, rtol=0)
    # one pool for every layer (vLLM's flag): the same tokens
    one = LLM(path, **SMALL, disable_hybrid_kv_cache_manager=True)
    assert one.engine.runner.num_window_pages is None and one.engine.block_manager.window_pages is None
    assert [o.token_ids for o in one.generate(PROMPTS, GREEDY)] == outs


def test_a_window_pool_too_short_for_every_sequence_queues_them_and_loses_nothing(gemma3, monkeypatch):
    ref, path = gemma3
    monkeypatch.setattr(kv_budget, "window_pool_size", lambda *a: 9)  # one window's span and a little
    llm = LLM(path, **{**SMALL, "max_num_batched_tokens": 64})
    assert llm.engine.runner.num_window_pages == 9
    prompts = PROMPTS + [p[::-1] for p in PROMPTS]
    outs = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert llm.engine.scheduler.num_preemptions > 0 and all_back(llm)
    assert all(transformers_greedy(ref, p, o) for p, o in zip(prompts, outs))


def test_drafts_logprobs_and_the_torch_kernels_over_a_window_pool(gemma3):
    _, path = gemma3
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=True, top_logprobs=2)
    repeats = [p[:20] * 4 for p in PROMPTS[:2]]  # the n-gram drafts find something to propose
    base = LLM(path, **SMALL, disable_hybrid_kv_cache_manager=True).generate(repeats, params)
    for extra in ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
                  {"kernels": "torch", "enforce_eager": True}):
        llm = LLM(path, **SMALL, **extra)
        assert llm.engine.runner.num_window_pages is not None
        outs = llm.generate(repeats, params)
        for o, b in zip(outs, base):
            assert o.token_ids == b.token_ids
            torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
            assert [[t for t, _ in top] for top in o.top_logprobs] == [[t for t, _ in top] for top in b.top_logprobs]
        assert all_back(llm)


def test_bench_memory_splits_the_budget_as_the_engine_does(gemma3):
    from qoqserve.bench.memory import plan_memory
    from qoqserve.bench.precisions import get_precision
    from qoqserve.model_loader import load_model_source
    _, path = gemma3
    arch = load_model_source(path).arch
    plan = plan_memory(arch, get_precision("fp32"), "cpu", seq_len=100, budget_bytes=2**24, max_num_seqs=4)
    stats = LLM(path, dtype="float32", kv_cache_gb=2**24 / 2**30, max_num_seqs=4).engine.stats()
    assert plan.num_window_pages == stats["num_window_kv_blocks"] is not None
    assert plan.num_pages == stats["num_kv_blocks"] > 3 * plan.num_window_pages
    assert (plan.kv_bytes_per_token, plan.window_kv_bytes_per_token) == (stats["kv_bytes_per_token"],
                                                                          stats["window_kv_bytes_per_token"])
    assert plan.max_concurrent_seqs == 4  # the sliding pool is sized for the engine's most sequences
    # a budget without one page: nothing fits, said as a plan
    none = plan_memory(arch, get_precision("fp32"), "cpu", seq_len=100, memory_bytes=plan.weight_bytes)
    assert (none.num_pages, none.max_concurrent_seqs) == (0, 0)


def test_the_pools_stay_consistent_through_random_traffic():
    """Prompts sharing prefixes, chunked prefills, decodes, bursts, scored
    passes, finishes and preemptions at random. Each step's sequences hold
    the pages of what it computes and reads; after it, each page's holders
    are the sequences whose held range has its block, free pages are exactly
    those held by none, no two blocks share a page, and the runner's map
    (every update replayed) says where each block's page is."""
    import random
    rng = random.Random(0)
    bm = hybrid(num_blocks=120, pages=24)
    wp = bm.window_pages
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=48), bm, max_model_len=1000)
    runner_map: dict[int, int] = {}
    stems = [list(range(1000 * i, 1000 * i + 100)) for i in range(3)]
    for it in range(400):
        if rng.random() < 0.3 and len(sched.waiting) < 4:
            stem = rng.choice(stems)
            sched.add(seq(f"r{it}", stem[:rng.randrange(1, 100)] + [rng.randrange(5000, 6000)
                                                                   for _ in range(rng.randrange(0, 60))]))
        batch = sched.schedule()
        ahead = rng.randrange(1, 4) if batch.decodes and rng.random() < 0.3 else 0
        if ahead and not bm.reserve(batch.decodes, ahead):
            ahead = 0
        # what this step computes and reads has its pages: from the window of its first query on
        for s, first, end in [(s, len(s) - 1, len(s) + ahead) for s in batch.decodes] + [
                (s, s.num_computed_tokens, s.num_computed_tokens + n) for s, n in batch.prefills]:
            assert s.num_released_blocks <= max(0, (first - WINDOW + 1 - KEY_TILE) // BS)
            assert s.num_window_blocks >= -(-end // BS)
        if rng.random() < 0.05:
            pages = bm.take_scratch(rng.randrange(1, 8))
            if pages is not None:
                bm.release_scratch(pages)
        for s in step(sched, batch):
            if len(s) - s.num_prompt_tokens > rng.randrange(1, 200):
                sched.finish(s, "length")
        if sched.running and rng.random() < 0.03:
            sched._preempt(sched.running.pop())
        runner_map.update(wp.take_updates())
        holders = [0] * wp.num_pages
        for s in sched.running:
            for b in s.block_table[s.num_released_blocks:s.num_window_blocks]:
                holders[wp.page_of[b]] += 1
        assert holders == wp.refs
        assert sorted(list(wp.passed) + list(wp.free)) == [p for p in range(wp.num_pages) if not wp.refs[p]]
        assert all(wp.block_of[p] == b for b, p in wp.page_of.items())
        assert len(set(wp.page_of.values())) == len(wp.page_of)
        assert all(runner_map.get(b, wp.pad_page) == wp.page_of.get(b, wp.pad_page)
                   for b in set(runner_map) | set(wp.page_of))
    for s in list(sched.running) + list(sched.waiting):
        sched.finish(s, "abort")
    assert wp.num_free == wp.num_pages and bm.num_free_blocks == bm.num_blocks
