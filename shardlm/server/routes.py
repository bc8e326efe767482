"""``POST /v1/chat/completions`` and ``POST /v1/completions``; vLLM's ``POST /tokenize`` and ``/detokenize``.

A request is validated (400), then waits for its first output before any header is
sent, so the engine's refusals still get their status code (400, 429 queue full, 503
engine dead). After that a streamed answer reports a failure as a last ``data:`` event
holding an error body, as OpenAI and vLLM do; an unstreamed one as a 503.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from shardlm.server.errors import APIError, from_validation
from shardlm.server.generation import ClientGone, Generation, until_disconnect
from shardlm.server.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    detokenize,
    prepare,
    tokenize,
)
from shardlm.server.responses import ChatShape, EventStream, Shape, dumps

CLIENT_CLOSED = 499  # nginx's code for "client closed the request": counted in metrics, seen by nobody


async def chat_completions(request: Request) -> Response:
    return await _complete(request, ChatRequest, ChatShape)


async def completions(request: Request) -> Response:
    return await _complete(request, CompletionRequest, Shape)


async def tokenize_route(request: Request) -> JSONResponse:
    s = request.app.state
    return JSONResponse(tokenize(await _parse(request, TokenizeRequest), s.engine, s.model_name))


async def detokenize_route(request: Request) -> JSONResponse:
    s = request.app.state
    return JSONResponse(detokenize(await _parse(request, DetokenizeRequest), s.engine, s.model_name))


async def _parse(request: Request, schema):
    """The request body as ``schema``, or a 400 naming the bad field."""
    try:
        return schema.model_validate_json(await request.body())
    except ValidationError as e:
        raise from_validation(e, schema) from None


async def _complete(
    request: Request, schema: type[ChatRequest] | type[CompletionRequest], shape_type: type[Shape]
) -> Response:
    arrival = time.perf_counter()
    state = request.app.state
    req = await _parse(request, schema)
    prepared = prepare(req, state.engine, state.model_name)
    gen = Generation(state.engine, prepared, state.metrics, arrival, endpoint=request.url.path)
    shape = shape_type(state.model_name, gen)
    deltas = gen.deltas()
    try:
        first = await until_disconnect(anext(deltas), request.receive)
        if not prepared.stream:
            await until_disconnect(_rest(deltas), request.receive)
            gen.keep_best()
            return JSONResponse(shape.full())
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    except BaseException:
        await deltas.aclose()
        raise
    return EventStream(_events(shape, first, deltas))


async def _rest(deltas: AsyncGenerator) -> None:
    async for _ in deltas:  # the choices gather their text
        pass


async def _events(shape: Shape, first, deltas: AsyncGenerator) -> AsyncGenerator[str, None]:
    try:
        for body in shape.opening():
            yield dumps(body)
        delta = first
        while True:
            if (chunk := shape.chunk(delta)) is not None:
                yield dumps(chunk)
            if all(c.finish_reason is not None for c in shape.gen.choices):
                break
            delta = await anext(deltas)
        if shape.include_usage:
            yield dumps(shape.usage_chunk())
    except APIError as e:
        yield dumps(e.body())
    finally:
        await deltas.aclose()
    yield "[DONE]"
