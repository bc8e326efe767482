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

from shardlm.server.generation import ClientGone, Delta, Generation, until_disconnect


class Shape:
    """How one endpoint spells its answers."""

    prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    def __init__(self, model: str, generation: Generation):
        self.model, self.gen = model, generation
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.include_usage = generation.prepared.include_usage

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _choice(self, content, finish_reason: str | None, token_ids: list[int] | None) -> dict:
        choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": finish_reason}
        return self._ids(choice, token_ids)

    def _ids(self, choice: dict, token_ids: list[int] | None) -> dict:
        if self.gen.prepared.return_token_ids and token_ids is not None:
            choice["prompt_token_ids"], choice["token_ids"] = self.gen.prepared.prompt_ids, token_ids
        return choice

    def full(self, text: str) -> dict:
        return {
            **self._head(self.object),
            "choices": [self._choice(text, self.gen.finish_reason, self.gen.token_ids)],
            "usage": self.gen.usage(),
        }

    def opening(self) -> list[dict]:
        """Chunks sent before the first text."""
        return []

    def chunk(self, delta: Delta) -> dict | None:
        """A chunk for this delta, or None when it has nothing to say."""
        if not delta.text and delta.finish_reason is None and not self.gen.prepared.return_token_ids:
            return None
        body = {
            **self._head(self.chunk_object),
            "choices": [self._chunk_choice(delta.text, delta.finish_reason, delta.token_ids)],
        }
        if self.include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the last
        return body

    def _chunk_choice(self, text: str, finish_reason: str | None, token_ids: list[int]) -> dict:
        return self._choice(text, finish_reason, token_ids)

    def usage_chunk(self) -> dict:
        return {**self._head(self.chunk_object), "choices": [], "usage": self.gen.usage()}


class ChatShape(Shape):
    prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def _choice(self, content, finish_reason, token_ids):
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": content},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        return self._ids(choice, token_ids)

    def opening(self) -> list[dict]:
        body = {
            **self._head(self.chunk_object),
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            ],
        }
        if self.include_usage:
            body["usage"] = None
        return [body]

    def _chunk_choice(self, text, finish_reason, token_ids):
        delta = {"content": text} if text or finish_reason is None else {}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return self._ids(choice, token_ids)


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
