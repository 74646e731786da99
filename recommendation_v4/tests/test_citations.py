"""The project cites only what it ships: no section of a specification that is not part of it."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Not the project's text: the environment, git, scratch, and the stores and runs a checkout makes.
SKIP_TOP = {".venv", ".git", ".dev"}
SKIP_UNDER_PROJECT = {"data", "runs"}
UNSHIPPED = re.compile(r"\bSPEC\b(?!S)|§\s*\d")


def shipped_text_files() -> list[Path]:
    found = []
    for path in REPO.rglob("*"):
        parts = path.relative_to(REPO).parts
        if parts[0] in SKIP_TOP or parts[0].startswith(".gpuw"):
            continue
        if parts[0] == "recommendation_v4" and len(parts) > 1 and parts[1] in SKIP_UNDER_PROJECT:
            continue
        if path.suffix in (".py", ".md", ".toml", ".sh", ".txt", ".sbatch") and path.is_file():
            found.append(path)
    return found


def test_no_file_cites_a_specification_the_project_does_not_ship():
    here = Path(__file__).resolve()
    cited = [
        f"{path.relative_to(REPO)}:{n}"
        for path in shipped_text_files()
        if path != here
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), start=1)
        if UNSHIPPED.search(line)
    ]
    assert cited == []
