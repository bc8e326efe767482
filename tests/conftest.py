"""Shared fixtures: tiny HF reference models, built once per session."""

from __future__ import annotations

import pytest

from reference import build_tiny


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """tiny(name) -> Reference: a saved random HF model and HF's outputs on PROMPTS."""
    built = {}

    def get(name: str):
        if name not in built:
            built[name] = build_tiny(name, tmp_path_factory.mktemp(name))
        return built[name]

    return get
