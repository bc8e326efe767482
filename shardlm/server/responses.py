"""OpenAI response bodies (whole and streamed chunks), and the SSE response that sends them.

Chat: ``chat.completion`` / ``chat.completion.chunk`` (the first chunk carries the
assistant role, the last the finish reason, then an optional usage-only chunk with
empty ``choices``); completions: ``text_completion`` for both. With the
``return_token_ids`` extension a choice also carries ``prompt_token_ids`` and
``token_ids`` (vLLM's names).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator

from starlette.responses import Response

from shardlm.engine.sampling import TokenLogprob
from shardlm.server.generation import ClientGone, Delta, Generation, until_disconnect


class Shape:
    """How one endpoint spells its answers."""

    prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    def __init__(self, model: str, generation: Generation):
        self.model, self.gen = model, generation
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.include_usage = generation.prepared.include_usage
        self.offsets = [0] * generation.prepared.choices  # completions' text_offset: each choice's so far
        self.token_text = generation.engine.tokenizer.decode

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _choice(self, index: int, content, finish_reason: str | None, token_ids, logprobs) -> dict:
        choice = {"index": index, "text": content, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._ids(choice, index, token_ids)

    def _ids(self, choice: dict, index: int, token_ids: list[int] | None) -> dict:
        p = self.gen.prepared
        if p.return_token_ids and token_ids is not None:
            choice["prompt_token_ids"], choice["token_ids"] = p.prompts[index // p.params.n], token_ids
        return choice

    def logprobs(self, index: int, token_ids: list[int], entries: list[TokenLogprob]) -> dict | None:
        """OpenAI's completions logprobs for these tokens of choice ``index``."""
        if self.gen.prepared.logprobs is None:
            return None
        tokens = [self.token_text([t]) for t in token_ids]
        offsets = []
        for t in tokens:
            offsets.append(self.offsets[index])
            self.offsets[index] += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self.token_text([i]): v for i, v in e.top} for e in entries],
            "text_offset": offsets,
        }

    def full(self) -> dict:
        return {
            **self._head(self.object),
            "choices": [
                self._choice(i, c.text, c.finish_reason, c.token_ids, self.logprobs(i, c.token_ids, c.logprobs))
                for i, c in enumerate(self.gen.choices)
            ],
            "usage": self.gen.usage(),
        }

    def opening(self) -> list[dict]:
        """Chunks sent before the first text."""
        return []

    def chunk(self, delta: Delta) -> dict | None:
        """A chunk for this delta, or None when it has nothing to say."""
        p = self.gen.prepared
        if not (delta.text or delta.finish_reason is not None or p.return_token_ids or p.logprobs is not None):
            return None
        logprobs = self.logprobs(delta.index, delta.token_ids, delta.logprobs)
        body = {
            **self._head(self.chunk_object),
            "choices": [self._chunk_choice(delta.index, delta.text, delta.finish_reason, delta.token_ids, logprobs)],
        }
        if self.include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the last
        return body

    def _chunk_choice(self, index: int, text: str, finish_reason: str | None, token_ids, logprobs) -> dict:
        return self._choice(index, text, finish_reason, token_ids, logprobs)

    def usage_chunk(self) -> dict:
        return {**self._head(self.chunk_object), "choices": [], "usage": self.gen.usage()}


class ChatShape(Shape):
    prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def _choice(self, index, content, finish_reason, token_ids, logprobs):
        choice = {
            "index": index,
            "message": {"role": "assistant", "content": content},
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        return self._ids(choice, index, token_ids)

    def logprobs(self, index, token_ids, entries):
        """OpenAI's chat logprobs: each token with its text, bytes and top alternatives."""
        if self.gen.prepared.logprobs is None:
            return None

        def item(token: int, logprob: float) -> dict:
            text = self.token_text([token])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        content = [
            {**item(t, e.logprob), "top_logprobs": [item(i, v) for i, v in e.top]} for t, e in zip(token_ids, entries)
        ]
        return {"content": content, "refusal": None}

    def opening(self) -> list[dict]:
        bodies = []
        for index in range(self.gen.prepared.choices):
            body = {
                **self._head(self.chunk_object),
                "choices": [
                    {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
            if self.include_usage:
                body["usage"] = None
            bodies.append(body)
        return bodies

    def _chunk_choice(self, index, text, finish_reason, token_ids, logprobs):
        delta = {"content": text} if text or finish_reason is None else {}
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._ids(choice, index, token_ids)


def dumps(body: dict) -> str:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


class EventStream(Response):
    """Server-sent events (``data: ...``), stopped and cleaned up as soon as the client hangs up.

    Starlette's StreamingResponse notices a gone client only when a write fails, which
    for a request still waiting in the queue may be never; this one listens for the
    disconnect and cancels the stream, which aborts the request on the engine.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[str, None]):
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        async def stream() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for data in self.events:
                await send({"type": "http.response.body", "body": f"data: {data}\n\n".encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await until_disconnect(stream(), receive)
        except (ClientGone, OSError):
            pass  # nobody left to tell
        finally:
            await self.events.aclose()
