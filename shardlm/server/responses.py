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
from collections.abc import AsyncGenerator
from typing import cast

from starlette.responses import Response

from shardlm.engine.sampling import TokenLogprob
from shardlm.server.generation import ClientGone, Delta, Generation, until_disconnect


class Shape:
    """How one endpoint spells its answers."""

    prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    def __init__(self, model: str, generation: Generation):
        self.model, self.gen = model, generation
        self.id = f"{self.prefix}-{generation.id}"
        self.created = int(time.time())
        self.include_usage = generation.prepared.include_usage
        self.offsets = [0] * generation.prepared.choices  # completions' text_offset: each choice's so far
        self.started: set[int] = set()  # choices whose first chunk went out (it carries the echo)
        self.token_text = generation.engine.tokenizer.decode

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def prompt_ids(self, index: int) -> list[int]:
        p = self.gen.prepared
        return p.prompts[index // self.gen.per_prompt]

    def _choice(self, index: int, content, finish_reason: str | None, token_ids, logprobs, lead: bool) -> dict:
        p = self.gen.prepared
        if lead and p.echo is not None:  # the prompt leads the text
            content = p.echo[index // self.gen.per_prompt] + content
        choice = {"index": index, "text": content, "logprobs": logprobs, "finish_reason": finish_reason}
        if lead and p.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.prompt_logprobs(index)
        return self._ids(choice, index, token_ids)

    def _ids(self, choice: dict, index: int, token_ids: list[int] | None) -> dict:
        if self.gen.prepared.return_token_ids and token_ids is not None:
            choice["prompt_token_ids"], choice["token_ids"] = self.prompt_ids(index), token_ids
        return choice

    def prompt_logprobs(self, index: int) -> list[dict | None]:
        """vLLM's ``prompt_logprobs``: None for the first prompt token, then per token
        {token id: {"logprob", "rank", "decoded_token"}} for it and the top k."""
        k = cast(int, self.gen.prepared.prompt_logprobs)
        out: list[dict | None] = [None]
        for token, e in zip(self.prompt_ids(index)[1:], self.gen.choices[index].prompt_logprobs):
            entry = {str(token): {"logprob": e.logprob, "rank": e.rank, "decoded_token": self.token_text([token])}}
            for rank, (i, v) in enumerate(e.top[:k], 1):
                entry.setdefault(str(i), {"logprob": v, "rank": rank, "decoded_token": self.token_text([i])})
            out.append(entry)
        return out

    def logprobs(self, index: int, token_ids: list[int], entries: list[TokenLogprob], lead: bool) -> dict | None:
        """OpenAI's completions logprobs for these tokens of choice ``index`` (with echo, the
        prompt's tokens lead; the first has no logprob)."""
        p = self.gen.prepared
        if p.logprobs is None:
            return None
        pairs: list[tuple[int, TokenLogprob | None]] = list(zip(token_ids, entries))
        if lead and p.echo is not None:
            ids = self.prompt_ids(index)
            pairs = [(ids[0], None), *zip(ids[1:], self.gen.choices[index].prompt_logprobs), *pairs]
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, e in pairs:
            text = self.token_text([token])
            out["tokens"].append(text)
            out["text_offset"].append(self.offsets[index])
            self.offsets[index] += len(text)
            out["token_logprobs"].append(None if e is None else e.logprob)
            out["top_logprobs"].append(None if e is None else {self.token_text([i]): v for i, v in e.top[: p.logprobs]})
        return out

    def full(self) -> dict:
        return {
            **self._head(self.object),
            "choices": [
                self._choice(
                    i, c.text, c.finish_reason, c.token_ids, self.logprobs(i, c.token_ids, c.logprobs, True), True
                )
                for i, c in enumerate(self.gen.choices)
            ],
            "usage": self.gen.usage(),
        }

    def opening(self) -> list[dict]:
        """Chunks sent before the first text."""
        return []

    def chunk(self, delta: Delta) -> dict | None:
        """A chunk for this delta, or None when it has nothing to say (the first chunk of a choice
        carries what leads it: the echoed prompt, prompt logprobs)."""
        p = self.gen.prepared
        if not delta.token_ids and delta.finish_reason is None:
            return None  # prompt logprobs alone: they go out with the choice's first chunk
        lead = delta.index not in self.started
        if not (delta.text or delta.finish_reason is not None or p.return_token_ids or p.logprobs is not None or lead):
            return None
        self.started.add(delta.index)
        logprobs = self.logprobs(delta.index, delta.token_ids, delta.logprobs, lead)
        body = {
            **self._head(self.chunk_object),
            "choices": [
                self._chunk_choice(delta.index, delta.text, delta.finish_reason, delta.token_ids, logprobs, lead)
            ],
        }
        if self.include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the last
        return body

    def _chunk_choice(self, index: int, text: str, finish_reason: str | None, token_ids, logprobs, lead: bool) -> dict:
        return self._choice(index, text, finish_reason, token_ids, logprobs, lead)

    def usage_chunk(self) -> dict:
        return {**self._head(self.chunk_object), "choices": [], "usage": self.gen.usage()}


class ChatShape(Shape):
    prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def _choice(self, index, content, finish_reason, token_ids, logprobs, lead):
        choice = {
            "index": index,
            "message": {"role": "assistant", "content": content},
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        return self._ids(choice, index, token_ids)

    def full(self) -> dict:
        body = super().full()
        if self.gen.prepared.prompt_logprobs is not None:  # vLLM's: one prompt, beside the choices
            body["prompt_logprobs"] = self.prompt_logprobs(0)
        return body

    def chunk(self, delta: Delta) -> dict | None:
        lead = not self.started
        body = super().chunk(delta)
        if body is not None and lead and self.gen.prepared.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.prompt_logprobs(0)
        return body

    def logprobs(self, index, token_ids, entries, lead):
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

    def _chunk_choice(self, index, text, finish_reason, token_ids, logprobs, lead):
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
