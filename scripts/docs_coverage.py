"""List what an earlier README documented that docs/ (and the README, CONTRIBUTING, tests/README)
no longer mention: every --flag, endpoint path, metric name and `backticked` name.

    python scripts/docs_coverage.py 875d5c9      # the README before it was split into docs/

A one-off check for moving documentation around without losing anything; tests/unit/test_docs.py
is the standing check (every CLI option and request field is in docs/)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(rev: str) -> int:
    old = subprocess.run(["git", "show", f"{rev}:README.md"], capture_output=True, text=True, check=True).stdout
    pages = [*ROOT.glob("docs/*.md"), ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "tests/README.md"]
    new = "\n".join(p.read_text() for p in pages if p.exists())
    kinds = {
        "flags": set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", old)),
        "paths": set(re.findall(r"(/v1/[a-z/]+|/health|/metrics)", old)),
        "metrics": set(re.findall(r"shardlm_[a-z0-9_]+", old)),
        "backticked": set(re.findall(r"`([^`\n]{1,60})`", old)),
    }
    lost = 0
    for kind, names in kinds.items():
        missing = sorted(n for n in names if not re.search(re.escape(n) + r"(?![\w-])", new))
        lost += len(missing)
        print(
            f"{kind}: {len(names)} in the old README, {len(missing)} not found now"
            + (f": {missing}" if missing else "")
        )
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "HEAD"))
