"""The engine loop on its own thread, with an asyncio face for the HTTP server.

Only the engine thread ever touches the LLMEngine: requests and aborts reach it
through an inbox, and outputs go back to each request's asyncio queue with
call_soon_threadsafe. A forward pass therefore never blocks the event loop,
and no engine state is shared between threads.

Overload: at most `max_waiting` requests wait (admitted, no token yet); one
more is refused with QueueFullError before anything is queued or a response
starts, so the server answers 429 instead of letting the queue, and the
memory it holds, grow without bound. The count lives here, on the event
loop, not in the scheduler: the scheduler sees a request only once the
engine thread has taken it from the inbox, too late to refuse it with a
status code; and the offline LLM API queues whole batches at once, unbounded.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable

from qoqserve.engine.llm_engine import LLMEngine, PreparedRequest
from qoqserve.engine.output import RequestOutput
from qoqserve.errors import QueueFullError, WorkerFailedError
from qoqserve.sampling_params import SamplingParams
from qoqserve.server.streams import Stream, put_all, rss_bytes

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


class _Waiting:
    """One request's place in the waiting count; given back exactly once: at its
    first output, its end, or (a stream never started) when it is collected."""

    def __init__(self, owner: AsyncEngine):
        self.owner: AsyncEngine | None = owner
        owner.num_waiting += 1

    def release(self) -> None:
        if self.owner is not None:
            self.owner.num_waiting -= 1
            self.owner = None


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_step: Callable[[LLMEngine, list[RequestOutput]], None] | None = None,
                 own_thread: bool = True, max_waiting: int | None = None, retry_after_s: int = 1):
        """own_thread False: the caller runs run_loop() on a thread of its own
        choosing (`serve` uses the main thread: OpenMP kernels called from any
        other thread pay a slow team start per parallel region, ~60 us here).
        max_waiting None or 0: no bound on the waiting requests."""
        self.engine = engine
        self.max_waiting = max_waiting or None
        self.retry_after_s = retry_after_s
        self.num_waiting = 0  # event loop only: admitted requests without a first output yet
        self.num_refused = 0
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.sampling_defaults = engine.sampling_defaults
        self.vocab_size = engine.arch.vocab_size
        self._on_step = on_step
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, Stream] = {}
        self._stopping = False
        self._loop_faults = 0  # engine.step() itself raised (beyond what it isolates)
        self._last_loop_fault: str | None = None
        self._drain_deadline: float | None = None
        self.stats: dict = engine.stats()  # snapshot, refreshed by the engine thread
        self._done = threading.Event()
        self._loop_started = False
        self._thread = threading.Thread(target=self._run_thread, name="qoqserve-engine", daemon=True)
        if own_thread:
            self._thread.start()

    @property
    def shares_prefixes(self) -> bool:
        """Whether a request started after another's prefill reuses its prompt's pages."""
        return self.engine.block_manager.enable_prefix_caching

    @property
    def is_alive(self) -> bool:
        return not self._done.is_set() and not self._stopping

    def health(self) -> dict:
        """What /health reports: "degraded" once a step failure could not be put on
        one request (its requests failed; the server went on). Pinned failures
        ended only their own request and leave the status "ok"."""
        st = self.stats
        engine_faults = st.get("engine_faults", 0) + self._loop_faults
        return {"status": "degraded" if engine_faults else "ok",
                "request_faults": st.get("request_faults", 0), "engine_faults": engine_faults,
                "last_engine_fault": self._last_loop_fault or st.get("last_engine_fault"),
                "num_running": st.get("num_running", 0), "num_waiting": self.num_waiting,
                "max_waiting": self.max_waiting, "num_refused": self.num_refused,
                "kv_free_blocks": st.get("num_free_blocks", 0), "kv_total_blocks": st.get("num_kv_blocks", 0),
                "rss_bytes": rss_bytes(), "gc_frozen_objects": gc.get_freeze_count()}

    def prepare_request(self, prompt: str | list[int], params: SamplingParams,
                        max_tokens_must_fit: bool = False, add_special_tokens: bool = True,
                        priority: int = 0) -> PreparedRequest:
        """The engine's admission checks (pure, so any thread may call them)."""
        return self.engine.prepare_request(prompt, params, max_tokens_must_fit, add_special_tokens, priority)

    def generate(self, request_id: str, request: PreparedRequest) -> AsyncIterator[RequestOutput]:
        """The request's outputs, as steps produce them. Raises at once (before a
        response starts, so the server can still pick the status) when the
        engine is not running or the waiting queue is full. Leaving the
        iteration early (client gone, task cancelled) aborts the request."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        if self.max_waiting is not None and self.num_waiting >= self.max_waiting:
            self.num_refused += 1
            raise QueueFullError(f"the server is overloaded: {self.num_waiting} requests are waiting "
                                 f"(--max-waiting-queue-length {self.max_waiting}); retry later",
                                 self.retry_after_s)
        place = _Waiting(self)
        outputs = self._outputs(request_id, request, place)
        weakref.finalize(outputs, place.release)  # a response that never iterated it
        return outputs

    async def _outputs(self, request_id: str, request: PreparedRequest,
                       place: _Waiting) -> AsyncIterator[RequestOutput]:
        stream = Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._inbox.put(("add", request_id, request, stream))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                place.release()  # running (or ended): no longer waiting
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            place.release()
            if not finished:
                self.abort(request_id)

    async def prompt_logprobs(self, token_ids: list[int], top_k: int):
        """LLMEngine.prompt_token_logprobs on the engine thread, between steps
        (a scored pass over the prompt, as long as one prefill of it)."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        stream = Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._inbox.put(("score", token_ids, top_k, stream))
        result = await stream.queue.get()
        if isinstance(result, BaseException):
            raise result
        return result

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def drain(self, grace_s: float) -> None:
        """Give the requests in flight grace_s seconds, then end them with finish_reason
        "abort", so their streams close normally instead of being cut."""
        self._inbox.put(("drain", time.monotonic() + grace_s))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort whatever is still in flight and stop the engine thread."""
        self._stopping = True  # generate() refuses new work from now on
        self._inbox.put(("stop",))
        if self._thread.is_alive() or self._loop_started:
            self._done.wait(timeout)

    # ---- engine thread ------------------------------------------------------

    def run_loop(self) -> None:
        """The engine loop, until shutdown(); on the engine thread, or on the
        caller's when constructed with own_thread=False."""
        self._loop_started = True
        try:
            self._loop()
        finally:
            self._done.set()
            self._refuse_inbox()

    def _refuse_inbox(self) -> None:
        """The loop has ended: whoever still waits on a message gets an error, not silence."""
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] in ("add", "score"):
                msg[-1].put(EngineDeadError("the engine is not running"))

    def _run_thread(self) -> None:
        try:
            self.run_loop()
        except WorkerFailedError:
            pass  # logged by _step; the loop has ended, so requests get 503s

    def _loop(self) -> None:
        while True:
            # block only when there is nothing to compute (with a timeout, so a
            # loop on the main thread still runs signal handlers)
            block = not self.engine.has_unfinished()
            try:
                msg = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                msg = None
            while msg is not None:
                if msg[0] == "stop":
                    self._abort_all(None)
                    return
                self._handle(msg)
                try:
                    msg = self._inbox.get_nowait()
                except queue.Empty:
                    msg = None
            if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline:
                self._abort_all(None)
            if self.engine.has_unfinished():
                self._step()

    def _handle(self, msg: tuple) -> None:
        if msg[0] == "add":
            _, rid, request, stream = msg
            try:
                self.engine.add_request(rid, request)
            except Exception as e:  # bad input: the caller gets the error, the loop goes on
                stream.put(e)
                return
            self._streams[rid] = stream
        elif msg[0] == "score":
            _, ids, top_k, stream = msg
            try:
                stream.put(self.engine.prompt_token_logprobs(ids, top_k))
            except Exception as e:
                stream.put(e)
        elif msg[0] == "drain":
            self._drain_deadline = msg[1]
        elif msg[0] == "abort":
            rid = msg[1]
            if self._streams.pop(rid, None) is not None:
                self.engine.abort(rid)
                self._refresh_stats([])

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except WorkerFailedError as e:
            # a tensor-parallel rank is gone: nothing can run any more; end the
            # streams and the loop (the server answers 503 from now on)
            log.error("engine failed: %s", e)
            self._abort_all(e)
            raise
        except Exception as e:
            # the engine isolates failures of the model step itself; this is a
            # failure outside it (scheduling, bookkeeping), which no request can be
            # blamed for: fail the requests in flight (abort frees their pages),
            # report it on /health and keep serving
            log.exception("engine step failed; aborting %d requests", len(self._streams))
            self._loop_faults += 1
            self._last_loop_fault = f"{type(e).__name__}: {e}"
            self._abort_all(RuntimeError(f"engine step failed: {e}"))
            return
        ready = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            ready.append((stream, out))
            if out.finished:
                del self._streams[out.request_id]
        put_all(ready)
        self._refresh_stats(outputs)

    def _abort_all(self, error: BaseException | None) -> None:
        ended = []
        for rid, stream in list(self._streams.items()):
            self.engine.abort(rid)
            ended.append((stream, error if error is not None else RequestOutput(
                request_id=rid, prompt_token_ids=[], token_ids=[], text="", delta_text="",
                delta_token_ids=[], finished=True, finish_reason="abort")))
        put_all(ended)
        self._streams.clear()
        self._refresh_stats([])

    def _refresh_stats(self, outputs: list[RequestOutput]) -> None:
        self.stats = self.engine.stats()
        if self._on_step is not None:
            try:
                self._on_step(self.engine, outputs)
            except Exception:
                log.exception("metrics hook failed")
