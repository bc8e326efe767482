"""Where a model and its defaults come from: a HF hub id found in the local HF cache (never
downloaded), generation_config.json's sampling defaults, a chat template given on the command line."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest

from shardlm.args import chat_template
from shardlm.engine.llm import sampling_defaults
from shardlm.models.config import ConfigError
from shardlm.models.loader import open_checkpoint

CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
          "num_hidden_layers": 2, "num_attention_heads": 4}  # fmt: skip


def fake_cache(root, repo: str, files: dict[str, dict]):
    """The layout huggingface_hub leaves: models--ORG--NAME/{refs/main, snapshots/REV/...}."""
    top = root / f"models--{repo.replace('/', '--')}"
    snap = top / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (top / "refs").mkdir()
    (top / "refs" / "main").write_text("0123abcd")
    for name, content in files.items():
        (snap / name).write_text(json.dumps(content))
    return snap


def test_a_hub_id_opens_from_the_local_cache(tmp_path, monkeypatch):
    snap = fake_cache(tmp_path, "acme/tiny", {"config.json": CONFIG})
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    ckpt = open_checkpoint("acme/tiny")
    assert ckpt.path == snap and ckpt.config.num_layers == 2
    with pytest.raises(ConfigError, match=rf"'acme/other' is not a local path and is not in the HF cache {tmp_path}"):
        open_checkpoint("acme/other")


def test_generation_config_gives_the_default_sampling_fields(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 100, "do_sample": True, "eos_token_id": 2})
    )
    ckpt = SimpleNamespace(path=tmp_path)
    assert sampling_defaults("auto", ckpt) == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 100}
    assert sampling_defaults("vllm", ckpt) == {}
    assert sampling_defaults(str(tmp_path), SimpleNamespace(path=tmp_path / "x.gguf")) == {
        "temperature": 0.6, "top_p": 0.9, "max_tokens": 100
    }  # fmt: skip
    assert sampling_defaults("auto", SimpleNamespace(path=tmp_path / "model.gguf")) == {}  # a GGUF file: none
    with pytest.raises(Exception, match="no generation_config.json there"):
        sampling_defaults(str(tmp_path / "nowhere"), ckpt)


def test_chat_template_flag_takes_a_file_or_the_template(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}")
    assert chat_template(str(f)) == "{{ messages[0]['content'] }}"
    assert chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}").startswith("{%")
    with pytest.raises(argparse.ArgumentTypeError, match="neither a file nor a Jinja template"):
        chat_template("no-such-file.jinja")
