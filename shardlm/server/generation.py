"""One request through the engine: text deltas with stop strings cut, usage counts, timing.

Leaving ``Generation.deltas()`` early (a stop string matched, the client went away,
the task was cancelled) closes the engine's stream, which aborts the request on the
ranks and frees its KV blocks. ``until_disconnect`` cancels a request's work as soon as
its client hangs up, also while it is still waiting in the queue.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Awaitable
from dataclasses import dataclass

from shardlm.engine.async_llm import EngineDead, QueueFull
from shardlm.engine.text import StopText
from shardlm.errors import UsageError
from shardlm.server.errors import APIError
from shardlm.server.protocol import Prepared


@dataclass
class Delta:
    text: str  # new text (may be '' while a possible stop string is held back)
    token_ids: list[int]  # tokens generated since the previous delta
    finish_reason: str | None = None  # "stop" or "length" on the last delta


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


class Generation:
    def __init__(self, engine, prepared: Prepared, metrics, arrival: float):
        self.engine, self.prepared, self.metrics, self.arrival = engine, prepared, metrics, arrival
        self.token_ids: list[int] = []
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.first: float | None = None  # time.perf_counter() of the first and the latest token
        self.last: float | None = None

    def usage(self) -> dict:
        prompt, done = len(self.prepared.prompt_ids), len(self.token_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": done,
            "total_tokens": prompt + done,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    async def deltas(self) -> AsyncGenerator[Delta, None]:
        """Raises APIError: 400 (the engine refused the request), 429 (queue full), 503 (engine dead)."""
        p = self.prepared
        stream = self.engine.generate(p.prompt_ids, p.params)
        text = StopText(self.engine.tokenizer, p.stops)
        outcome: str | None = "abort"  # until it finishes; None when the engine refused it
        started = False
        self.metrics.in_flight.inc()
        try:
            async for out in stream:
                if not started:
                    started = True
                    self.metrics.prompt_tokens.inc(len(p.prompt_ids))
                if out.token_ids:
                    self.last = time.perf_counter()
                    self.first = self.first or self.last
                    self.token_ids += out.token_ids
                # a stop token (EOS or stop_token_ids) ends the text without being part of it, as in vLLM
                shown = out.token_ids[:-1] if out.finish_reason == "stop" else out.token_ids
                delta = text.push(shown)
                if out.finish_reason is not None:
                    self.cached_tokens = out.cached_tokens
                    delta += text.flush()
                if text.stopped or out.finish_reason is not None:
                    # a stop string ends it as a stop token would; leaving the loop aborts it on the ranks
                    self.finish_reason = outcome = "stop" if text.stopped else out.finish_reason
                    yield Delta(delta, out.token_ids, self.finish_reason)
                    return
                yield Delta(delta, out.token_ids)
            raise EngineDead("the engine's stream ended without a finish reason")
        except UsageError as e:
            outcome = None
            raise APIError(400, str(e)) from None
        except QueueFull as e:
            outcome = None
            raise APIError(429, f"the server is at capacity ({e}); retry later") from None
        except EngineDead as e:
            outcome = "error"
            raise APIError(
                503, f"the engine failed and this server is shutting down: {e}", code="engine_dead"
            ) from None
        finally:
            await stream.aclose()  # no-op when it already finished; else aborts the request
            self.metrics.in_flight.dec()
            if outcome is not None:
                self.metrics.cached_tokens.inc(self.cached_tokens)
                self.metrics.observe(
                    arrival=self.arrival, first=self.first, last=self.last, tokens=len(self.token_ids), reason=outcome
                )


async def until_disconnect(work: Awaitable, receive):
    """Await ``work``; if the client disconnects first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this coroutine itself is cancelled
        watch.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
