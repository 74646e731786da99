#!/usr/bin/env python3
"""Regenerate the figures that README.md and docs/*.md quote from results files.

A quoted figure sits in a block whose opening marker names where it comes from:

    <!-- results: PATH [PATH ...] [table=N] [rows=I,J,...] [cols=I,J,...] [head=A,B,...] [caption] -->
    (generated text: do not edit by hand)
    <!-- /results -->

- PATH: a Markdown results file, relative to the repository root
  (recommendation_v4/benchmarks/results/*.md, rcp/README.md).
- table=N: the file's N-th Markdown table (1-based; default 1).
- rows=I,J,...: only these body rows (1-based, in the order given); default all.
- cols=I,J,...: only these columns (1-based, in the order given); default all. The first column
  (the row names) is always kept, first.
- caption: the paragraph just above the table comes first.
- Several PATHs: their tables are joined side by side on the first column (which must read the
  same in every file, row by row): the first column once, then each file's other columns in
  turn.
- head=A,B,...: new headers for the columns after the first, in order.

With no rows/cols/join the table is the file's lines verbatim. Every block ends with a line
naming its source file(s), linked relative to the page that holds the block.

    python tools/readme_figures.py           # rewrite stale blocks in place
    python tools/readme_figures.py --check   # exit 1, one line per stale block

Options are split like a shell line (quote a value with spaces: head="one GPU,two GPUs").
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OPEN = re.compile(r"^<!-- results: (?P<spec>.+?) -->$")
CLOSE = "<!-- /results -->"


class FigureError(Exception):
    pass


@dataclass
class Block:
    page: Path          # the Markdown file that holds the block
    line: int           # 1-based line of the opening marker
    spec: str           # the marker's text after "results:"
    start: int          # index of the first generated line
    end: int            # index of the closing marker
    current: list[str]  # the lines between the markers now


def pages(root: Path = REPO) -> list[Path]:
    """The files whose blocks are kept: README.md and docs/*.md."""
    return [p for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))] if p.exists()]


def find_blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = OPEN.match(lines[i].strip())
        if m is None:
            if lines[i].strip() == CLOSE:
                raise FigureError(f"{page.name}:{i + 1}: {CLOSE} without an opening marker")
            i += 1
            continue
        j = i + 1
        while j < len(lines) and lines[j].strip() != CLOSE:
            if OPEN.match(lines[j].strip()):
                raise FigureError(f"{page.name}:{i + 1}: results block not closed before line {j + 1}")
            j += 1
        if j == len(lines):
            raise FigureError(f"{page.name}:{i + 1}: results block never closed ({CLOSE})")
        blocks.append(Block(page, i + 1, m["spec"], i + 1, j, lines[i + 1:j]))
        i = j + 1
    return blocks


def _tables(text: str) -> list[tuple[list[str], list[str]]]:
    """Each Markdown table of the text: (its lines, the paragraph just above it)."""
    lines = text.splitlines()
    found, i = [], 0
    while i < len(lines):
        if lines[i].startswith("|"):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            end = i  # the paragraph above: skip blank lines, then take lines up to a blank one
            while end > 0 and not lines[end - 1].strip():
                end -= 1
            k = end
            while k > 0 and lines[k - 1].strip() and not lines[k - 1].startswith(("|", "#", "```")):
                k -= 1
            found.append((lines[i:j], lines[k:end]))
            i = j
        else:
            i += 1
    return found


def _cells(line: str) -> list[str]:
    body = line.strip()
    if not (body.startswith("|") and body.endswith("|")):
        raise FigureError(f"not a table row: {line!r}")
    return [c.strip() for c in re.split(r"(?<!\\)\|", body[1:-1])]


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _indices(value: str, count: int, what: str, path: str) -> list[int]:
    try:
        picked = [int(v) for v in value.split(",")]
    except ValueError:
        raise FigureError(f"{what}={value}: expected numbers like 1,3") from None
    bad = [v for v in picked if not 1 <= v <= count]
    if bad:
        raise FigureError(f"{what}={value}: {path} has {count} {what} (1-{count})")
    return [v - 1 for v in picked]


def generate(spec: str, page: Path, root: Path = REPO) -> list[str]:
    """The lines a block with this marker text holds."""
    try:
        words = shlex.split(spec)
    except ValueError as exc:
        raise FigureError(f"cannot read the marker: {exc}") from None
    paths, opts, caption = [], {}, False
    for word in words:
        if word == "caption":
            caption = True
        elif "=" in word:
            key, value = word.split("=", 1)
            if key not in ("table", "rows", "cols", "head"):
                raise FigureError(f"unknown option {key}= (table, rows, cols, head, caption)")
            opts[key] = value
        else:
            paths.append(word)
    if not paths:
        raise FigureError("the marker names no results file")
    number = int(opts.get("table", "1"))
    picked = []  # per file: (header cells, align cells, body rows as cells, raw lines, caption)
    for path in paths:
        file = root / path
        if not file.is_file():
            raise FigureError(f"{path}: no such file")
        tables = _tables(file.read_text())
        if not 1 <= number <= len(tables):
            raise FigureError(f"table={number}: {path} has {len(tables)} table(s)")
        lines, above = tables[number - 1]
        if len(lines) < 2:
            raise FigureError(f"{path}: table {number} has no header")
        picked.append((_cells(lines[0]), _cells(lines[1]), [_cells(l) for l in lines[2:]], lines, above))

    plain = len(paths) == 1 and not {"rows", "cols", "head"} & opts.keys()
    if plain:
        table = picked[0][3]
    else:
        first_body = picked[0][2]
        rows = (_indices(opts["rows"], len(first_body), "rows", paths[0]) if "rows" in opts
                else list(range(len(first_body))))
        # The first column is the key: always kept, once.
        head, align, body = [picked[0][0][0]], [picked[0][1][0]], [[first_body[r][0]] for r in rows]
        for path, (h, a, b, _, _) in zip(paths, picked):
            if len(b) != len(first_body) or any(b[r][0] != first_body[r][0] for r in rows):
                raise FigureError(f"{path}: its first column does not match {paths[0]}'s, row by row")
            cols = _indices(opts["cols"], len(h), "cols", path) if "cols" in opts else range(len(h))
            cols = [c for c in cols if c != 0]
            head += [h[c] for c in cols]
            align += [a[c] for c in cols]
            for out, r in zip(body, rows):
                out += [b[r][c] for c in cols]
        if "head" in opts:
            names = [v.strip() for v in opts["head"].split(",")]
            if len(names) != len(head) - 1:
                raise FigureError(f"head= names {len(names)} columns, the block has {len(head) - 1} besides the first")
            head[1:] = names
        table = [_row(head), _row(align), *(_row(r) for r in body)]

    out = []
    if caption:
        if len(paths) > 1:
            raise FigureError("caption takes one results file")
        if not picked[0][4]:
            raise FigureError(f"caption: {paths[0]} has no paragraph just above table {number}")
        out += [*picked[0][4], ""]
    out += table
    links = ", ".join(f"[`{p}`]({Path(os.path.relpath(root / p, page.parent)).as_posix()})" for p in paths)
    out += ["", f"<sub>From {links} (block regenerated by `tools/readme_figures.py`).</sub>"]
    return out


def stale_blocks(root: Path = REPO) -> list[str]:
    """One line per block that differs from what its files give (or cannot be generated)."""
    problems = []
    for page in pages(root):
        rel = page.relative_to(root).as_posix()
        try:
            blocks = find_blocks(page)
        except FigureError as exc:
            problems.append(f"{rel}: {exc}")
            continue
        for block in blocks:
            try:
                if block.current != ["", *generate(block.spec, page, root), ""]:
                    problems.append(f"{rel}:{block.line}: stale results block ({block.spec}); "
                                    f"run python tools/readme_figures.py")
            except FigureError as exc:
                problems.append(f"{rel}:{block.line}: {exc}")
    return problems


def rewrite(root: Path = REPO) -> tuple[list[str], list[str]]:
    """Rewrite every block in place; returns (pages changed, errors)."""
    changed, errors = [], []
    for page in pages(root):
        rel = page.relative_to(root).as_posix()
        lines = page.read_text().splitlines()
        try:
            blocks = find_blocks(page)
        except FigureError as exc:
            errors.append(f"{rel}: {exc}")
            continue
        for block in reversed(blocks):  # from the end, so earlier indices stay valid
            try:
                lines[block.start:block.end] = ["", *generate(block.spec, page, root), ""]
            except FigureError as exc:
                errors.append(f"{rel}:{block.line}: {exc}")
        text = "\n".join(lines) + "\n"
        if text != page.read_text():
            page.write_text(text)
            changed.append(rel)
    return changed, errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report stale blocks, change nothing")
    args = parser.parse_args(argv)
    if args.check:
        problems = stale_blocks()
        for line in problems:
            print(line)
        return 1 if problems else 0
    changed, errors = rewrite()
    for line in errors:
        print(line, file=sys.stderr)
    for rel in changed:
        print(f"rewrote the results blocks of {rel}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
