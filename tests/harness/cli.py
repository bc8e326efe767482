"""Run the `shardlm` command as a user would (the installed script), or its ``main`` in this process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from shardlm.cli import main

BIN = Path(sys.executable).parent


def shardlm(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "shardlm"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
    )


def main_exit(argv: list[str], capsys) -> tuple[int, str]:
    """(exit status, stderr) of the command's own ``main`` (what the installed ``shardlm``
    calls) run in this process: a second each for errors caught before any rank starts,
    instead of a process start-up each."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    return code, capsys.readouterr().err
