"""The figures the README quotes are tied to the results files they come from.

(a) Blocks. Every block between ``<!-- results: FILE ... -->`` and ``<!-- /results -->`` in
README.md and docs/*.md holds exactly what ``tools/readme_figures.py`` generates from its file(s)
(``python tools/readme_figures.py --check`` says the same; without ``--check`` it rewrites them).

(b) No figure from memory. Outside those blocks, the README may not carry a measurement that no
results file holds. A *measurement-looking number* is a number (digits, optional thousands
separators and decimals; in a range such as ``1-2 min`` both ends) followed, after at most one
space, by a unit:

- a rate or a size: samples/s, events/s, tokens/s, TFLOP/s, GB/s, GFLOP, TB, GB, MB, TiB, GiB,
  MiB, KiB;
- a duration: ms, µs, s, min, h, second(s), minute(s), hour(s);
- a count in millions or billions: ``M samples``, ``B events`` (samples, events, rows, tokens,
  parameters);
- a share: ``%``;
- a ratio: a number with a decimal point and ``x`` or ``×`` attached (``1.31x``; ``8× H100``
  counts GPUs and ``0.5 × 1e-6`` multiplies, so neither is one).

Bold and code marks (``*``, backticks) are ignored; a number glued to a word, a dot or a hyphen
(``Yambda-5B``, ``x86-64``, ``sm_100``) is not a number. Each such number is *backed* when one
Markdown or JSON file under ``recommendation_v4/benchmarks/results/`` or ``rcp/`` holds it as
written (a whole number, not part of a longer one: ``2,093`` does not back ``2093`` or ``12,093``)
and, in the same file, its unit: attached to the number for ``%`` and ratios (``47.6%``,
``1.97x``), anywhere as a whole word for the others. Figures that need more context than a results
file gives belong in docs/, next to their command and results file.

(c) Links. Every relative link of README.md and docs/*.md points at a file or directory that
exists, and at one of its headings when it names an anchor.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BACKING_DIRS = (REPO / "recommendation_v4" / "benchmarks" / "results", REPO / "rcp")

_spec = importlib.util.spec_from_file_location("readme_figures", REPO / "tools" / "readme_figures.py")
figures = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("readme_figures", figures)
_spec.loader.exec_module(figures)

NUM = r"\d+(?:,\d{3})*(?:\.\d+)?"
UNIT = (
    r"samples/s|events/s|tokens/s|TFLOP/s|GB/s|GFLOP|TiB|GiB|MiB|KiB|TB|GB|MB|ms|µs|"
    r"seconds?|minutes?|hours?|min|s|h|[MB] (?:samples|events|rows|tokens|parameters)"
)
MEASURE = re.compile(
    rf"(?<![\w.,\-])(?P<a>{NUM})(?:\s?(?:-|–)\s?(?P<b>{NUM}))?"
    rf"(?:\s?(?P<unit>{UNIT})(?![\w/])|\s?(?P<pct>%))"
)
RATIO = re.compile(r"(?<![\w.,\-])(?P<a>\d+(?:,\d{3})*\.\d+)[x×](?!\w)")


def measurements(text: str) -> list[tuple[int, str, str]]:
    """(line, number, unit) of every measurement-looking number of the text, outside results blocks."""
    found, inside = [], False
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if figures.OPEN.match(stripped):
            inside = True
            continue
        if stripped == figures.CLOSE:
            inside = False
            continue
        if inside:
            continue
        plain = re.sub(r"[*`]", "", line)
        for m in MEASURE.finditer(plain):
            unit = "%" if m["pct"] else m["unit"]
            found += [(n, m[g], unit) for g in ("a", "b") if m[g]]
        found += [(n, m["a"], "x") for m in RATIO.finditer(plain)]
    return found


def backing_texts() -> dict[str, str]:
    return {
        str(p.relative_to(REPO)): p.read_text(errors="replace")
        for d in BACKING_DIRS
        for p in sorted(d.rglob("*"))
        if p.suffix in (".md", ".json")
    }


def is_backed(number: str, unit: str, text: str) -> bool:
    whole = rf"(?<![\d.,]){re.escape(number)}(?!\d|[.,]\d)"
    if unit == "%":
        return re.search(whole + r"\s?%", text) is not None
    if unit == "x":
        return re.search(whole + r"[x×]", text) is not None
    return re.search(whole, text) is not None and re.search(rf"(?<![\w/]){re.escape(unit)}(?![\w/])", text) is not None


def unbacked(text: str, files: dict[str, str]) -> list[str]:
    return [
        f"README.md:{line}: {number} {unit}"
        for line, number, unit in measurements(text)
        if not any(is_backed(number, unit, body) for body in files.values())
    ]


def test_results_blocks_equal_what_their_files_give():
    assert figures.stale_blocks(REPO) == []
    readme_blocks = figures.find_blocks(REPO / "README.md")
    assert len(readme_blocks) >= 2  # the README does quote its headline figures from results files


def test_the_check_command_agrees():
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "readme_figures.py"), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout == ""


def test_readme_measurements_outside_blocks_are_found_in_results_files():
    problems = unbacked((REPO / "README.md").read_text(), backing_texts())
    assert problems == [], "figures in the README that no results file holds:\n" + "\n".join(problems)


def test_the_rule_catches_what_it_should():
    files = {
        "r.md": "| measure | value |\n| loop samples/s | 2,093 |\n| MFU | 47.6% |\n"
        "| speedup | 1.97x |\n| train min | 68.5 |\n"
    }
    good = "Loop: 2,093 samples/s, MFU 47.6%, 1.97x, 68.5 min. 8× H100, Yambda-5B, x86-64, LR 0.5 × 1e-6."
    assert unbacked(good, files) == []
    assert measurements("Yambda-5B on x86-64 with 8× H100 and sm_100, GBS 8,192") == []
    for bad in (
        "runs at 2,094 samples/s",
        "runs at 2093 samples/s",
        "takes 12,093 ms",
        "a 2.05x speedup",
        "about 38-50 GB",
        "in **45 s**",
        "1-2 minutes",
        "at 69 M samples",
        "uses 47.7%",
        "`train min` 68.5 h",
    ):
        assert unbacked(bad, files) != [], bad
    # A figure inside a results block is the block's business, not this rule's.
    block = "<!-- results: r.md -->\n9,999 samples/s\n<!-- /results -->\n"
    assert measurements(block) == []


def test_a_stale_block_is_reported_and_rewritten(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "res.md").write_text("caption line\n\n| a | b |\n|---|---:|\n| x | 1 |\n| y | 2 |\n")
    page = tmp_path / "README.md"
    page.write_text("intro\n<!-- results: res.md rows=2 -->\n| a | b |\n| y | 3 |\n<!-- /results -->\nend\n")
    problems = figures.stale_blocks(tmp_path)
    assert len(problems) == 1 and problems[0].startswith("README.md:2: stale results block (res.md rows=2)")
    changed, errors = figures.rewrite(tmp_path)
    assert (changed, errors) == (["README.md"], [])
    assert figures.stale_blocks(tmp_path) == []
    text = page.read_text()
    assert "| y | 2 |" in text and "| x | 1 |" not in text and text.startswith("intro\n") and text.endswith("end\n")
    (tmp_path / "docs" / "page.md").write_text("<!-- results: missing.md -->\n<!-- /results -->\n")
    assert figures.stale_blocks(tmp_path) == ["docs/page.md:1: missing.md: no such file"]


LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """The heading anchors of a Markdown page, as GitHub spells them."""
    found, fence = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and re.match(r"#{1,6} ", line):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


@pytest.mark.parametrize("page", figures.pages(REPO), ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_resolve(page):
    broken = []
    for m in LINK.finditer(page.read_text()):
        target, _, anchor = m["target"].partition("#")
        if re.match(r"[a-z]+:", target):
            continue
        file = page.parent / target if target else page
        if not file.exists() or (anchor and file.suffix == ".md" and anchor not in anchors(file)):
            broken.append(m["target"])
    assert broken == []
