"""Model presets: trimmed public ``config.json`` files under ``data/`` (each cites its
``_source``), parsed by the same ``ModelConfig.from_hf`` as any user-supplied path."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from shardlm.models.config import ConfigError, ModelConfig
from shardlm.plan.errors import PlanError, unknown

DATA = Path(__file__).parent / "data"
PREFIX = "model-"


@lru_cache(maxsize=1)
def _presets() -> dict[str, Path]:
    """name or alias -> data file."""
    out: dict[str, Path] = {}
    for path in sorted(DATA.glob(f"{PREFIX}*.json")):
        name = path.stem[len(PREFIX) :]
        out[name] = path
        for alias in json.loads(path.read_text()).get("_aliases", []):
            out[alias] = path
    return out


def model_names(with_aliases: bool = False) -> list[str]:
    names = sorted(_presets())
    if with_aliases:
        return names
    return sorted({p.stem[len(PREFIX) :] for p in _presets().values()})


def preset_source(name: str) -> str:
    return json.loads(_presets()[name].read_text())["_source"]


def load_model(name_or_path: str) -> tuple[ModelConfig, str]:
    """(config, display name) for a preset name or a path to a HF ``config.json``."""
    key = name_or_path.lower()
    presets = _presets()
    if key in presets:
        path = presets[key]
        return ModelConfig.from_json_file(path), path.stem[len(PREFIX) :]
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" or path.exists():
        if not path.exists():
            raise PlanError(f"model config {str(path)!r} does not exist; pass a HF config.json path or a preset name")
        try:
            return ModelConfig.from_json_file(path), path.parent.name or path.stem
        except ConfigError as e:
            raise PlanError(str(e)) from None
    raise unknown("model", name_or_path, model_names(), hint=" (or pass a path to a HF config.json)")
