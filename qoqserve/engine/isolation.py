"""Finding the request that made a step fail, so that only it fails.

A step is one forward pass and one sampling call over a batch. When it
raises, the batch is split in halves and each half is run again, down to
single requests: a request that still fails alone while others succeed is
the culprit, and only it is ended; every other request keeps the tokens of
the sub-run it was in and goes on from there.

Re-running is exact because nothing a failed run did has been committed:
the scheduler counts tokens as computed only after a step succeeds, so a
re-run writes the same K/V to the same slots (and the kernels are
batch-invariant, so a request's values do not depend on who shares its
batch); the prefix cache registers pages only after a step succeeds; and the
sampler rolls back the seeded generators a failed run drew from.

A request whose grammar allows no token next (ConstraintDeadEndError) names
itself: it is ended and the step re-run without it, no bisection needed.

A failure that no single request explains (every request fails alone too,
or the batch holds only one) is retried once as a whole; when that fails as
well, every request of the step fails and the caller counts an engine fault
(/health reports it). A good step pays nothing for any of this: the
bisection runs only after a failure, about 2*log2(B) extra runs per culprit.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from qoqserve.engine.scheduler import ScheduledBatch
from qoqserve.errors import ConstraintDeadEndError, WorkerFailedError

log = logging.getLogger(__name__)

Sample = tuple[int, float | None, list | None]  # token, its logprob, its top logprobs


@dataclass
class StepOutcome:
    batch: ScheduledBatch            # what succeeded: the batch less the failed requests
    tokens: list[int]                # for batch.sampled, as the runner returns them
    logprobs: list | None
    top: list | None
    failed: dict[str, BaseException] = field(default_factory=dict)  # request id -> why
    pinned: bool = True              # False: the failure could not be put on one request


class StepIsolation:
    def __init__(self, runner):
        self.runner = runner

    def run(self, batch: ScheduledBatch) -> StepOutcome:
        dead_ends: dict[str, BaseException] = {}
        while True:
            try:
                out = StepOutcome(batch, *self.runner.run(batch))
            except WorkerFailedError:
                raise  # the ranks disagree now: re-running anything could only hang or lie
            except ConstraintDeadEndError as e:
                self.runner.rollback()
                dead_ends.update((rid, e) for rid in e.request_ids)
                batch = batch.only(set(batch.request_ids) - set(dead_ends))
                if batch.request_ids:
                    continue
                out = StepOutcome(batch, [], None, None)
            except Exception as e:
                self.runner.rollback()
                log.warning("step of %d requests failed (%s: %s); isolating the cause",
                            len(batch.request_ids), type(e).__name__, e)
                out = self._isolate(batch, e)
            out.failed.update(dead_ends)
            return out

    def _attempt(self, batch: ScheduledBatch, sampled: dict[str, Sample]) -> BaseException | None:
        """Run a sub-batch; on success record its samples, else return the error."""
        try:
            tokens, logprobs, top = self.runner.run(batch)
        except WorkerFailedError:
            raise
        except Exception as e:
            self.runner.rollback()
            return e
        for i, seq in enumerate(batch.sampled):
            sampled[seq.request_id] = (tokens[i], logprobs[i] if logprobs is not None else None,
                                       top[i] if top is not None else None)
        return None

    def _bisect(self, batch: ScheduledBatch, ids: list[str], sampled: dict[str, Sample],
                failed: dict[str, BaseException]) -> None:
        """ids failed together: run each half again, recursing into halves that fail."""
        mid = len(ids) // 2
        for half in (ids[:mid], ids[mid:]):
            err = self._attempt(batch.only(set(half)), sampled)
            if err is None:
                continue
            if len(half) == 1:
                failed[half[0]] = err
            else:
                self._bisect(batch, half, sampled, failed)

    def _isolate(self, batch: ScheduledBatch, first: BaseException) -> StepOutcome:
        ids = batch.request_ids
        sampled: dict[str, Sample] = {}
        failed: dict[str, BaseException] = {}
        if len(ids) > 1:
            self._bisect(batch, ids, sampled, failed)
            if len(failed) < len(ids):  # someone succeeded: the failures are those requests' own
                if failed:
                    log.warning("step failure pinned on %s", ", ".join(failed))
                return self._outcome(batch, sampled, failed, pinned=True)
        # not one request's fault as far as can be told: once more as a whole
        sampled.clear()
        err = self._attempt(batch, sampled)
        if err is None:
            log.warning("step succeeded when retried whole; nothing failed")
            return self._outcome(batch, sampled, {}, pinned=True)
        log.error("step failed again when retried (%s: %s); failing its %d requests",
                  type(err).__name__, err, len(ids))
        return self._outcome(batch, {}, {rid: err for rid in ids}, pinned=False)

    @staticmethod
    def _outcome(batch: ScheduledBatch, sampled: dict[str, Sample], failed: dict[str, BaseException],
                 pinned: bool) -> StepOutcome:
        kept = batch.only(set(batch.request_ids) - set(failed))
        rows = [sampled[s.request_id] for s in kept.sampled]
        tokens = [t for t, _, _ in rows]
        logprobs = [lp for _, lp, _ in rows] if any(lp is not None for _, lp, _ in rows) else None
        top = [tp for _, _, tp in rows] if any(tp is not None for _, _, tp in rows) else None
        return StepOutcome(kept, tokens, logprobs, top, failed, pinned)
