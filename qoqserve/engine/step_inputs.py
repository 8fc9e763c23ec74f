"""A step's model inputs as plain lists (StepInputs): what rank 0 broadcasts
to the tensor-parallel workers (engine/executor.py), and what every rank
turns into tensors (ModelRunner). One token per decode, then the draft
tokens of a speculative step (engine/speculative.py) as rows of their own,
then each prefill chunk."""
from __future__ import annotations

from dataclasses import dataclass

from qoqserve.engine.scheduler import ScheduledBatch
from qoqserve.engine.sequence import Sequence


def sampled_rows(batch: ScheduledBatch) -> list[int]:
    """The rows of a step (its decodes' tokens, then its chunks') whose logits
    are sampled: every decode, and the last token of each chunk that
    completes its sequence."""
    at, rows = len(batch.decodes), list(range(len(batch.decodes)))
    for seq, n in batch.prefills:
        at += n
        if seq.num_computed_tokens + n == len(seq):
            rows.append(at - 1)
    return rows


@dataclass
class StepInputs:
    """A step's model inputs as plain lists: what rank 0 broadcasts to the
    tensor-parallel workers (engine/executor.py), and what every rank turns
    into tensors."""
    ids: list[int]
    positions: list[int]
    slots: list[int]
    block_tables: list[list[int]]   # decodes (and drafts) first, then the prefill chunks
    context_lens: list[int]         # of the decodes (and drafts)
    query_starts: list[int] | None  # prefill chunks (cumulative, from the first prefill token)
    cached_lens: list[int] | None
    rows: list[int]                 # the rows whose logits are sampled


Row = tuple[Sequence, int, int]  # a decode row: the sequence, the position computed, its token


def decode_rows(decodes: list[Sequence], drafts: list[Row] = ()) -> list[Row]:
    """Each decode's newest token at its position, then the draft rows."""
    return [(seq, len(seq) - 1, seq.token_ids[-1]) for seq in decodes] + list(drafts)


def step_inputs(batch: ScheduledBatch, block_size: int,
                drafts: list[Row] = ()) -> StepInputs:
    """Flattened inputs of a step: each decode's newest token, each draft
    (sequence, position, token) attending up to its own position, then each
    prefill chunk."""
    if drafts and batch.prefills:
        raise ValueError("drafts are verified in steps of decodes only")
    rows = decode_rows(batch.decodes, drafts)
    ids = [t for _, _, t in rows]
    positions = [p for _, p, _ in rows]
    slots = [seq.slot(p, block_size) for seq, p, _ in rows]
    starts, cached = [0], []
    for seq, n in batch.prefills:
        start = seq.num_computed_tokens
        ids.extend(seq.token_ids[start:start + n])
        positions.extend(range(start, start + n))
        slots.extend(seq.slot(p, block_size) for p in range(start, start + n))
        starts.append(starts[-1] + n)
        cached.append(start)
    seqs = [seq for seq, _, _ in rows] + [s for s, _ in batch.prefills]
    sampled = list(range(len(rows))) if drafts else sampled_rows(batch)
    return StepInputs(ids, positions, slots, [s.block_table for s in seqs], [p + 1 for _, p, _ in rows],
                      starts if batch.prefills else None, cached if batch.prefills else None, sampled)
