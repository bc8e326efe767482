"""The OpenAI-compatible HTTP server: ``shardlm serve``.

``build_app(engine, model_name=...)`` wraps an ``AsyncLLM`` in a FastAPI app with
``/v1/chat/completions``, ``/v1/completions`` (SSE streaming or not), ``/v1/models``,
``/health`` and a Prometheus ``/metrics``; ``cli.add_parser`` adds the subcommand.

    protocol.py     request schemas (pydantic, strict types) -> prompt ids + SamplingParams
    errors.py       OpenAI-style error bodies; every bad input is a 400 that names the field
    text.py         streaming detokenization with stop strings cut out
    generation.py   one request through the engine: text deltas, usage, timing
    responses.py    OpenAI response and chunk bodies; SSE that cancels on client disconnect
    routes.py       the two completion endpoints
    metrics.py      Prometheus counters, gauges and histograms
    app.py          build_app: wires the above together
    cli.py          ``shardlm serve``
"""

__all__ = ["build_app"]


def __getattr__(name: str):
    """``build_app`` on first use: other commands (``shardlm train``) parse their flags without FastAPI."""
    if name == "build_app":
        from shardlm.server.app import build_app

        return build_app
    raise AttributeError(f"module 'shardlm.server' has no attribute {name!r}")
