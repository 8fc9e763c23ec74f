from qoqserve.config import SchedulerConfig
from qoqserve.engine.block_manager import BlockManager
from qoqserve.engine.scheduler import Scheduler
from qoqserve.engine.sequence import Sequence, SequenceStatus
from qoqserve.sampling_params import SamplingParams


def seq(rid, tokens):
    return Sequence(rid, list(tokens), SamplingParams(temperature=0))


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
    first = list(a.block_table)
    bm.deallocate(a)
    b = seq("b", range(9))
    bm.allocate(b)
    assert b.num_cached_tokens == 8 and b.block_table[:2] == first[:2]


def test_last_token_is_never_served_from_cache():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq("a", range(8))
    bm.allocate(a)
    b = seq("b", range(8))
    bm.allocate(b)
    # the second block holds b's last token: it must be computed, so not shared
    assert b.num_cached_tokens == 4


def test_hash_collision_is_not_a_hit(monkeypatch):
    bm = BlockManager(num_blocks=10, block_size=4)
    monkeypatch.setattr(BlockManager, "chain_hash", staticmethod(lambda tokens, prev: 42))
    a = seq("a", range(9))
    bm.allocate(a)
    b = seq("b", range(100, 109))
    bm.allocate(b)
    assert b.num_cached_tokens == 0


def test_decode_blocks_registered_for_reuse():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq("a", range(3))
    bm.allocate(a)
    for t in (3, 4):               # tokens 3 and 4: block 0 fills with token 3
        a.append(t, None)
        bm.on_token_computed(a)
        assert bm.can_append(a)
        bm.may_append(a)
    b = seq("b", [0, 1, 2, 3, 9])
    bm.allocate(b)
    assert b.num_cached_tokens == 4


def test_scheduler_preempts_newest_and_recovers():
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), bm, max_model_len=16)
    a, b = seq("a", range(4)), seq("b", range(10, 14))
    sched.add(a)
    sched.add(b)
    batch, prefill = sched.schedule()
    assert prefill and batch == [a, b]
    for s in (a, b):
        s.append(7, None)
    batch, prefill = sched.schedule()     # each needs a 2nd block: 4 used of 4
    assert not prefill and batch == [a, b]
    for _ in range(4):                    # fill the 2nd blocks, then a 3rd is needed
        for s in batch:
            s.append(7, None)
        batch, prefill = sched.schedule()
    assert batch == [a] and b.status == SequenceStatus.WAITING and sched.num_preemptions == 1
    assert not b.block_table
    sched.finish(a, "stop")
    batch, prefill = sched.schedule()
    assert prefill and batch == [b]
    sched.finish(b, "stop")
    assert bm.num_free_blocks == 4
