"""The results files of benchmarks that keep one row per label: ``results/<name>.json`` (every row)
and ``results/<name>.md`` (an intro, the table, and the command of each row)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

RESULTS = Path(__file__).parent / "results"


def save_labelled_row(name: str, row: dict, intro: str, table: Callable[[list[dict]], str]) -> None:
    """Add ``row`` (replacing an earlier row with its label) and rewrite both files."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    rows = json.loads(path.read_text())["rows"] if path.exists() else []
    rows = [r for r in rows if r["label"] != row["label"]] + [row]
    path.write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    commands = "\n".join(f"- {r['label']}: `{r['command']}`" for r in rows)
    (RESULTS / f"{name}.md").write_text(f"{intro}\n\n{table(rows)}\n\nCommands:\n{commands}\n")
