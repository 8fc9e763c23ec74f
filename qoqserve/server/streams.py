"""How a step's outputs reach the requests' asyncio queues from the engine
thread: one wake-up of each event loop a step (async_engine.py), and the
process's resident memory that /health reports."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass


def rss_bytes() -> int | None:
    """This process's resident memory (Linux /proc; None elsewhere): /health
    reports it so a soak run can watch it without access to the server's host."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclass
class Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        put_all([(self, item)])


def deliver(items: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in items:
        q.put_nowait(item)


def put_all(items: list[tuple[Stream, object]]) -> None:
    """One wake-up of each event loop for a whole step's outputs: a
    call_soon_threadsafe per stream would wake the loop (a pipe write each)
    once per sequence while the engine thread still needs the GIL."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for stream, item in items:
        by_loop.setdefault(stream.loop, []).append((stream.queue, item))
    for loop, batch in by_loop.items():
        loop.call_soon_threadsafe(deliver, batch)
