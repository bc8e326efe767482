"""One request through the engine: its choices' text deltas with stop strings cut, usage, timing.

A request has ``n`` choices of each of its prompts (several prompts: /v1/completions only);
their deltas come interleaved, each naming its choice (``index``).

Leaving ``Generation.deltas()`` early (a stop string matched, the client went away,
the task was cancelled) closes the engine's stream, which aborts the request on the
ranks and frees its KV blocks. ``until_disconnect`` cancels a request's work as soon as
its client hangs up, also while it is still waiting in the queue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable
from dataclasses import dataclass, field

from shardlm.engine.async_llm import EngineDead, QueueFull, StreamOutput
from shardlm.engine.sampling import TokenLogprob
from shardlm.engine.text import StopText
from shardlm.errors import UsageError
from shardlm.server.errors import APIError
from shardlm.server.protocol import Prepared

LOG = logging.getLogger("shardlm.requests")


@dataclass
class Delta:
    index: int  # which choice
    text: str  # new text (may be '' while a possible stop string is held back)
    token_ids: list[int]  # tokens generated since the previous delta
    logprobs: list[TokenLogprob]  # theirs, when the request asked for logprobs
    finish_reason: str | None = None  # "stop" or "length" on the last delta
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1, 2, ... scored since


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


class Choice:
    """One choice's answer so far."""

    def __init__(self, tokenizer, stops: tuple[str, ...], keep: bool = True):
        self.keep = keep  # False: the sampled tokens are dropped (echo with max_tokens 0 scores the prompt only)
        self.prompt_logprobs: list[TokenLogprob] = []
        self.stop_text = StopText(tokenizer, stops)
        self.text = ""  # what was handed out
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.cached_tokens = 0  # prompt tokens found in the prefix cache

    def take(self, out: StreamOutput) -> Delta:
        """This output's delta: its text (held back while it may start a stop string; cut before
        one), its tokens and logprobs."""
        self.prompt_logprobs += out.prompt_logprobs
        if not self.keep:
            self.finish_reason = "length" if out.finish_reason is not None else None
            return Delta(out.index, "", [], [], self.finish_reason, out.prompt_logprobs)
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        # a stop token (EOS or stop_token_ids) ends the text without being part of it, as in vLLM;
        # a stop string ends it inside the text, where stop_text cuts it
        by_token = out.finish_reason == "stop" and not isinstance(out.stop_reason, str)
        text = self.stop_text.push(out.token_ids[:-1] if by_token else out.token_ids)
        if out.finish_reason is not None:
            self.cached_tokens = out.cached_tokens
            text += self.stop_text.flush()
        if self.stop_text.stopped or out.finish_reason is not None:
            self.finish_reason = "stop" if self.stop_text.stopped else out.finish_reason
        self.text += text
        return Delta(out.index, text, out.token_ids, out.logprobs, self.finish_reason, out.prompt_logprobs)


class Generation:
    def __init__(self, engine, prepared: Prepared, metrics, arrival: float, endpoint: str = ""):
        self.engine, self.prepared, self.metrics, self.arrival = engine, prepared, metrics, arrival
        self.endpoint = endpoint  # for the request's log line
        self.id = uuid.uuid4().hex  # the response's id carries it too
        self.queue_s: float | None = None  # the first choice's wait for its first step
        self.generated = [
            Choice(engine.tokenizer, prepared.params.stop, keep=not prepared.drop_sampled)
            for _ in range(prepared.choices)
        ]
        self.choices = self.generated  # what the answer holds: fewer with best_of (keep_best)
        self.first: float | None = None  # time.perf_counter() of the first and the latest token
        self.last: float | None = None

    @property
    def per_prompt(self) -> int:
        """Choices answered per prompt (n; best_of generates more, ``keep_best`` keeps n)."""
        return len(self.choices) // len(self.prepared.prompts)

    def keep_best(self) -> None:
        """best_of: keep each prompt's n choices with the highest cumulative logprob, most likely first."""
        params = self.prepared.params
        if params.generated == params.n:
            return
        every = params.generated
        groups = [self.generated[i : i + every] for i in range(0, len(self.generated), every)]
        self.choices = [
            c for group in groups for c in sorted(group, key=lambda c: -sum(e.logprob for e in c.logprobs))[: params.n]
        ]

    @property
    def token_count(self) -> int:
        return sum(len(c.token_ids) for c in self.generated)  # best_of: every generated token counts

    def usage(self) -> dict:
        prompt, done = sum(len(p) for p in self.prepared.prompts), self.token_count
        every = self.prepared.params.generated  # a prompt's first choice computed it; the others found it cached
        return {
            "prompt_tokens": prompt,
            "completion_tokens": done,
            "total_tokens": prompt + done,
            "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in self.generated[::every])},
        }

    async def deltas(self) -> AsyncGenerator[Delta, None]:
        """Every choice's deltas as they come, until each has finished.
        Raises APIError: 400 (the engine refused the request), 429 (queue full), 503 (engine dead)."""
        p = self.prepared
        every = p.params.for_engine()  # best_of: all its samples as n, then keep_best picks
        stream = self.engine.generate_choices(p.prompts, dataclasses.replace(every, n=every.generated, best_of=None))
        outcome: str | None = "abort"  # until it finishes; None when the engine refused it
        started = False
        self.metrics.in_flight.inc()
        try:
            async for out in stream:
                if not started:
                    started = True
                    self.metrics.prompt_tokens.inc(sum(len(ids) for ids in p.prompts))
                if out.token_ids:
                    self.last = time.perf_counter()
                    self.first = self.first or self.last
                if out.queue_s is not None and self.queue_s is None:
                    self.queue_s = out.queue_s
                choice = self.choices[out.index]
                if choice.finish_reason is not None:
                    continue  # cut by a stop string already
                delta = choice.take(out)
                if all(c.finish_reason is not None for c in self.choices):
                    # settled before the last yield: a streaming consumer may close this generator
                    # once it has the last delta, and the generation did finish
                    outcome = "stop" if all(c.finish_reason == "stop" for c in self.choices) else "length"
                    yield delta
                    return
                yield delta
            raise EngineDead("the engine's stream ended without a finish reason")
        except UsageError as e:
            outcome = None
            self._log("refused", 400)
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
            await stream.aclose()  # no-op when it already finished; else aborts what has not
            self.metrics.in_flight.dec()
            if outcome is not None:
                self.metrics.cached_tokens.inc(self.usage()["prompt_tokens_details"]["cached_tokens"])
                self.metrics.observe(
                    arrival=self.arrival,
                    first=self.first,
                    last=self.last,
                    tokens=self.token_count,
                    reason=outcome,
                    queue=self.queue_s,
                )
                self._log(outcome)

    def _log(self, outcome: str, status: int = 200) -> None:
        """One line per request at info: what it asked, how it ended, how long it took."""
        if not LOG.isEnabledFor(logging.INFO):
            return
        u, at = self.usage(), lambda t: "-" if t is None else f"{t - self.arrival:.3f}s"
        queue = "-" if self.queue_s is None else f"{self.queue_s:.3f}s"
        LOG.info(
            f"{self.endpoint} {self.id[:12]} {status} {outcome}: {len(self.choices)} choice(s), prompt "
            f"{u['prompt_tokens']} (cached {u['prompt_tokens_details']['cached_tokens']}), generated "
            f"{u['completion_tokens']}, queue {queue}, ttft {at(self.first)}, e2e {at(self.last)}"
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
