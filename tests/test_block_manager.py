from qoqserve.config import SchedulerConfig
from qoqserve.engine.block_manager import BlockManager
from qoqserve.engine.scheduler import Scheduler
from qoqserve.engine.sequence import Sequence, SequenceStatus
from qoqserve.sampling_params import SamplingParams


def seq(rid, tokens):
    return Sequence(rid, list(tokens), SamplingParams(temperature=0))


def computed(bm, s):
    """As after a step that computed all of s: its full blocks become hits."""
    s.num_computed_tokens = len(s)
    bm.on_tokens_computed(s)


def test_allocate_and_free_all_pages():
    bm = BlockManager(num_blocks=10, block_size=4)
    a, b = seq("a", range(10)), seq("b", range(100, 105))
    bm.allocate(a)
    bm.allocate(b)
    assert len(a.block_table) == 3 and len(b.block_table) == 2
    assert bm.num_free_blocks == 5
    bm.deallocate(a)
    bm.deallocate(b)
    assert bm.num_free_blocks == 10 and not bm.used_ids


def test_prefix_hit_shares_pages_and_is_counted():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq("a", range(9))           # blocks [0-3] [4-7] [8]
    bm.allocate(a)
    computed(bm, a)
    b = seq("b", list(range(8)) + [50, 51])
    bm.allocate(b)
    assert b.num_cached_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    assert bm.prefix_hits == 8 and bm.prefix_queries == 9 + 10
    bm.deallocate(a)
    assert bm.blocks[b.block_table[0]].ref_count == 1
    bm.deallocate(b)
    assert bm.num_free_blocks == 10


def test_freed_pages_still_hit_until_reused():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq("a", range(9))
    bm.allocate(a)
    computed(bm, a)
    first = list(a.block_table)
    bm.deallocate(a)
    b = seq("b", range(9))
    bm.allocate(b)
    assert b.num_cached_tokens == 8 and b.block_table[:2] == first[:2]


def test_last_token_is_never_served_from_cache():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq("a", range(8))
    bm.allocate(a)
    computed(bm, a)
    b = seq("b", range(8))
    bm.allocate(b)
    # the second block holds b's last token: it must be computed, so not shared
    assert b.num_cached_tokens == 4


def test_hash_collision_is_not_a_hit(monkeypatch):
    bm = BlockManager(num_blocks=10, block_size=4)
    monkeypatch.setattr(BlockManager, "chain_hash", staticmethod(lambda tokens, prev: 42))
    a = seq("a", range(9))
    bm.allocate(a)
    computed(bm, a)
    b = seq("b", range(100, 109))
    bm.allocate(b)
    assert b.num_cached_tokens == 0


def test_decode_blocks_registered_for_reuse():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq("a", range(3))
    bm.allocate(a)
    a.num_computed_tokens = 3
    for t in (3, 4):               # tokens 3 and 4: block 0 fills with token 3
        a.append(t, None)
        assert bm.can_append(a)
        bm.may_append(a)
        a.num_computed_tokens += 1  # the step that runs token t
        bm.on_tokens_computed(a)
    b = seq("b", [0, 1, 2, 3, 9])
    bm.allocate(b)
    assert b.num_cached_tokens == 4


def step(sched, batch):
    """What the engine does after a forward pass: every sampled sequence gets token 7."""
    n = len(batch.sampled)
    return sched.postprocess(batch, [7] * n, None, None)


def test_scheduler_preempts_newest_and_recovers():
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), bm, max_model_len=16)
    a, b = seq("a", range(4)), seq("b", range(10, 14))
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert not batch.decodes and batch.prefills == [(a, 4), (b, 4)]
    step(sched, batch)
    batch = sched.schedule()              # each needs a 2nd block: 4 used of 4
    assert batch.decodes == [a, b] and not batch.prefills
    for _ in range(4):                    # fill the 2nd blocks, then a 3rd is needed
        step(sched, batch)
        batch = sched.schedule()
    assert batch.decodes == [a] and b.status == SequenceStatus.WAITING and sched.num_preemptions == 1
    assert not b.block_table
    step(sched, batch)
    sched.finish(a, "stop")
    batch = sched.schedule()
    # recomputed: prompt and its 5 tokens, less its first page (a prefix-cache hit)
    assert b.num_cached_tokens == 4 and batch.prefills == [(b, len(b) - 4)]
    sched.finish(b, "stop")
    assert bm.num_free_blocks == 4


def test_a_prompt_longer_than_the_budget_is_prefilled_in_chunks_beside_decodes():
    bm = BlockManager(num_blocks=32, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8), bm, max_model_len=64)
    a = seq("a", range(3))
    sched.add(a)
    step(sched, sched.schedule())          # a: prefilled, first token sampled
    b = seq("b", range(100, 120))          # 20 tokens, budget 8 per step
    sched.add(b)
    chunks = []
    while b.num_output_tokens == 0:
        batch = sched.schedule()
        assert batch.decodes == [a] and batch.num_tokens <= 8  # decodes first, then the rest
        chunks += [n for s, n in batch.prefills if s is b]
        sampled = step(sched, batch)
        assert (b in sampled) == (b.num_computed_tokens == 20)
    assert chunks == [7, 7, 6] and b.num_computed_tokens == 20


def test_long_prefill_threshold_caps_one_prompt_per_step():
    bm = BlockManager(num_blocks=32, block_size=4)
    cfg = SchedulerConfig(max_num_batched_tokens=16, long_prefill_token_threshold=5)
    sched = Scheduler(cfg, bm, max_model_len=64)
    a, b = seq("a", range(12)), seq("b", range(50, 62))
    sched.add(a)
    sched.add(b)
    assert sched.schedule().prefills == [(a, 5), (b, 5)]


def test_a_prompts_last_token_is_prefilled_even_when_it_is_all_that_is_left():
    # computed as a decode it would take the decode attention kernel, not the
    # prefill one a whole prompt takes: another sum order (docs/runtime.md)
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    first = seq("a", range(9))
    bm.allocate(first)
    computed(bm, first)
    again = seq("b", range(9))  # its first 8 tokens hit: only the last is left
    bm.allocate(again)
    assert again.num_computed_tokens == 8 and again.is_prefilling
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), bm, 64)
    sched.running.append(again)
    again.status = SequenceStatus.RUNNING
    batch = sched.schedule()
    assert not batch.decodes and batch.prefills == [(again, 1)] and batch.sampled == [again]
    again.num_computed_tokens = 9
    again.token_ids.append(42)  # sampled: from now on one decode a step
    assert not again.is_prefilling
    again.num_computed_tokens = 0  # preempted: recomputed up to its newest token, which decodes
    again.token_ids.append(43)
    assert again.is_prefilling
    again.num_computed_tokens = 10
    assert not again.is_prefilling


def test_a_sliding_window_model_gives_back_the_pages_before_its_window():
    from qoqserve.engine.block_manager import KEY_TILE
    bs, window = 16, 20
    bm = BlockManager(num_blocks=64, block_size=bs, window=window)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), bm, max_model_len=1024)
    a = seq("a", range(100))
    sched.add(a)
    while a.is_prefilling or len(a) < 400:  # chunks of 64, then decodes
        batch = sched.schedule()
        step(sched, batch)
        # every page a later query can read is held, the rest given back
        first_read = a.num_computed_tokens - window + 1 - KEY_TILE
        held = [i for i, b in enumerate(a.block_table) if bm.blocks[b].ref_count > 0 and b in bm.used_ids]
        assert a.num_released_blocks == max(0, first_read // bs)
        assert held == list(range(a.num_released_blocks, len(a.block_table)))
    assert bm.num_free_blocks == 64 - (len(a.block_table) - a.num_released_blocks)
    assert len(a.block_table) - a.num_released_blocks <= -(-(window + KEY_TILE) // bs) + 2
    sched.finish(a, "stop")  # the rest, once each
    assert bm.num_free_blocks == 64 and not bm.used_ids


def test_pages_given_back_keep_the_prefix_chain():
    # a prompt whose early pages were given back still hits them (their hashes
    # kept while free), and the pages after them were registered on the right chain
    bm = BlockManager(num_blocks=40, block_size=4, window=2)
    a = seq("a", range(150))
    bm.allocate(a)
    for n in range(1, 151):  # one token at a time: the window moves past the early pages
        a.num_computed_tokens = n
        bm.on_tokens_computed(a)
    assert a.num_released_blocks > 10
    bm.deallocate(a)
    assert bm.num_free_blocks == 40
    b = seq("b", range(150))
    bm.allocate(b)
    assert b.num_cached_tokens == 148
    c = seq("c", [999] + list(range(1, 150)))  # another first page: no page after it hits
    bm.deallocate(b)
    bm.allocate(c)
    assert c.num_cached_tokens == 0


def test_pages_of_models_with_some_full_attention_layers_are_all_kept():
    from qoqserve.models.arch import ModelArchConfig
    base = dict(architectures=["MistralForCausalLM"], vocab_size=8, hidden_size=8, intermediate_size=8,
                num_hidden_layers=2, num_attention_heads=1, sliding_window=64)
    assert ModelArchConfig.from_hf_config(base).window_of_every_layer == 64
    mixed = ModelArchConfig.from_hf_config({**base, "layer_types": ["sliding_attention", "full_attention"]})
    assert mixed.window_of_every_layer is None
