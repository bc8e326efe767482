"""The documentation covers the interface: every option of every `shardlm` sub-command and every
field of the server's request models appears in docs/, and README stays short with working links.

Derived from the parsers and models themselves, so a new flag or field without docs fails here."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from shardlm.cli import build_parser
from shardlm.server import protocol

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def docs_text() -> str:
    return "\n".join(p.read_text() for p in sorted(DOCS.glob("*.md")))


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command path, parser) for the top parser and every sub-command, recursively."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*path, name))


def options() -> list[tuple[str, str]]:
    """(command, option string) of every long option of every sub-command (--help excepted)."""
    out = []
    for path, parser in commands(build_parser()):
        for action in parser._actions:
            for opt in action.option_strings:
                if opt.startswith("--") and opt != "--help":
                    out.append((" ".join(path), opt))
    return out


def request_fields() -> list[tuple[str, str]]:
    models = [m for m in vars(protocol).values() if isinstance(m, type) and issubclass(m, BaseModel)]
    models = [m for m in models if m.__module__ == protocol.__name__]
    assert models, "no request models found in shardlm.server.protocol"
    return sorted({(m.__name__, f) for m in models for f in m.model_fields})


def test_every_cli_option_is_documented():
    text = docs_text()
    found = options()
    assert len(found) > 60, found  # the walk reached every sub-command
    missing = [f"shardlm {cmd} {opt}" for cmd, opt in found if not re.search(re.escape(opt) + r"(?![\w-])", text)]
    assert not missing, f"options with no mention in docs/*.md: {missing}"


def test_every_request_field_is_documented_in_serve_md():
    text = (DOCS / "serve.md").read_text()
    missing = [f"{model}.{field}" for model, field in request_fields() if f"`{field}`" not in text]
    assert not missing, f"request fields with no `name` in docs/serve.md: {missing}"


def test_readme_is_short_and_its_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 220
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    assert any(link.startswith("docs/") for link in links)
    broken = [link for link in links if not link.startswith("http") and not (ROOT / link).exists()]
    assert not broken, broken


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_each_page_starts_with_a_runnable_example(page):
    lines = (DOCS / page).read_text().splitlines()
    assert lines[0].startswith("# ")
    first_block = next(i for i, line in enumerate(lines) if line.startswith("```"))
    assert first_block < 6, f"{page}: the first example should come right after the title"
