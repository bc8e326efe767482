"""shardlm: run and train large language models across many devices with every parallel strategy.

``from shardlm import LLM, SamplingParams``. The names load on first use, so that
``import shardlm`` (and rank processes started with ``python -m shardlm.launch``)
does not pull in the engine before it is needed.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "shardlm.engine.llm",
    "RequestOutput": "shardlm.engine.llm",
    "CompletionOutput": "shardlm.engine.llm",
    "Logprob": "shardlm.engine.llm",
    "SamplingParams": "shardlm.engine.sampling",
    "StructuredOutputsParams": "shardlm.engine.structured",
    "ParallelDims": "shardlm.parallel.dims",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'shardlm' has no attribute {name!r}")
