"""One results file per measurement, each one in use: every measurement in benchmarks/results/ (a
``<name>.md`` and ``<name>.json`` pair counts as one) is named by a doc or read by a script, and
every results file a doc names is there.

A doc is any Markdown file of the repository outside benchmarks/results/ (README.md, docs/,
rcp/README.md, recommendation_v4/docs/, the benchmarks' README ...). A doc names a results file by
its path (``results/<name>.md``, a link to ``../recommendation_v4/benchmarks/results/<name>.md``,
a ``*`` standing for any part of the name) or by its bare file name (``<name>.md``). A script reads
one when a Python string under benchmarks/, dlrmv4/, tools/ or tests/ spells its name, an
f-string's fields standing for a word (``f"checkpoint_{gpu}"`` reads ``checkpoint_h100``)."""

from __future__ import annotations

import ast
import fnmatch
import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = Path("recommendation_v4/benchmarks/results")
SCRIPT_DIRS = ("recommendation_v4/benchmarks", "recommendation_v4/dlrmv4", "recommendation_v4/tests", "tools")
SKIP_DIRS = {"node_modules", "__pycache__", "build", "dist"}  # and every hidden folder (.git, .venv, ...)

# A path into results/: "results/<name>.md", "results/convergence_logs/<file>.json", "results/*.md".
PATH_REFERENCE = re.compile(r"results/([\w.*/-]+?\.(?:md|json))(?![\w.-])")
# A bare file name: "<name>.md" not preceded by a path separator or a word character.
BARE_REFERENCE = re.compile(r"(?<![\w./*-])([\w.-]+\.(?:md|json))(?![\w.-])")
# A commit-suffixed name, as superseded copies of a measurement were named ("train_h200-abc1234").
COMMIT_SUFFIX = re.compile(r"-[0-9a-f]{7,40}(?=$|[-_])")
FIELD = "[A-Za-z0-9_]+"  # what an f-string's field stands for: a word (a GPU, a label), no "-" or "."


def _files(root: Path, suffix: str) -> list[Path]:
    """The files under ``root`` ending in ``suffix``, hidden folders and build outputs left out."""
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if not d.startswith(".") and d not in SKIP_DIRS)
        found += [Path(folder) / n for n in names if n.endswith(suffix)]
    return sorted(found)


def docs(root: Path = REPO) -> list[Path]:
    results = root / RESULTS
    return [p for p in _files(root, ".md") if results not in p.parents]


def measurements(root: Path = REPO) -> set[str]:
    """The measurements in results/ (top level): each file's name without .md / .json."""
    return {p.stem for p in (root / RESULTS).iterdir() if p.is_file() and p.suffix in (".md", ".json")}


def _stem(name: str) -> str:
    return name.rsplit(".", 1)[0]


def doc_references(root: Path = REPO) -> dict[str, list[str]]:
    """Each results file a doc names (a path under results/, glob characters kept), with the docs
    naming it. A bare name counts when a results file of that name is there, when it carries a
    commit suffix (a superseded copy's name) or when it extends a measurement's name after a "-"."""
    present = measurements(root)
    found: dict[str, list[str]] = {}
    for doc in docs(root):
        text = doc.read_text(errors="replace")
        where = str(doc.relative_to(root))
        names = set(PATH_REFERENCE.findall(text))
        for bare in BARE_REFERENCE.findall(text):
            stem = _stem(bare)
            if stem in present or COMMIT_SUFFIX.search(stem) or any(stem.startswith(m + "-") for m in present):
                names.add(bare)
        for name in names:
            found.setdefault(name, []).append(where)
    return found


def _string_patterns(source: str) -> set[str]:
    """The regular expressions a Python file's strings spell: a constant as it is, an f-string with
    each field standing for a word; an f-string with fewer than three letters of its own is left out
    (``f"{name}.json"`` names no file)."""
    patterns: set[str] = set()
    tree = ast.parse(source)
    parts_of_fstrings = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    for node in ast.walk(tree):
        if id(node) in parts_of_fstrings:
            continue
        if isinstance(node, ast.JoinedStr):
            parts = [re.escape(v.value) if isinstance(v, ast.Constant) else FIELD for v in node.values]
            literal = "".join(v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str))
            if len(re.sub(r"\.(md|json)$", "", literal)) >= 3:
                patterns.add("".join(parts))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) < 200:
            patterns.add(re.escape(node.value))
    return patterns


def script_inputs(root: Path = REPO) -> set[str]:
    """The measurements a script's strings name (``"scaling"``, ``"checkpoint_{gpu}.json"``)."""
    patterns: set[str] = set()
    for folder in SCRIPT_DIRS:
        for path in _files(root / folder, ".py"):
            if path.resolve() != Path(__file__).resolve():
                patterns |= _string_patterns(path.read_text(errors="replace"))
    compiled = [re.compile(p) for p in patterns]
    return {
        name
        for name in measurements(root)
        if any(c.fullmatch(n) for c in compiled for n in (name, name + ".json", name + ".md"))
    }


def unreferenced(root: Path = REPO) -> list[str]:
    """The measurements neither a doc names (by its .md or its .json) nor a script reads."""
    named = {_stem(Path(ref).name) for ref in doc_references(root) if "/" not in ref}
    # A glob names the measurements it matches if it spells three letters of a name ("hot_ids_*.md");
    # "results/*.json" names none.
    globs = [_stem(ref) for ref in doc_references(root) if "*" in ref and len(_stem(ref).replace("*", "")) >= 3]
    read = script_inputs(root)
    return sorted(
        name
        for name in measurements(root)
        if name not in named and name not in read and not any(fnmatch.fnmatchcase(name, g) for g in globs)
    )


def missing(root: Path = REPO) -> list[str]:
    """The results files a doc names that are not there ("<file> (<doc>, ...)")."""
    results = root / RESULTS
    gone = []
    for ref, where in sorted(doc_references(root).items()):
        there = list(results.glob(ref)) if "*" in ref else [results / ref] if (results / ref).is_file() else []
        if not there:
            gone.append(f"{ref} ({', '.join(sorted(where))})")
    return gone


def test_every_measurement_is_named_by_a_doc_or_read_by_a_script():
    left = unreferenced()
    assert not left, (
        f"{len(left)} results in {RESULTS} that no doc names and no script reads (a superseded copy? "
        f"git keeps it: delete it): {', '.join(left)}"
    )


def test_every_results_file_a_doc_names_is_there():
    gone = missing()
    assert not gone, "docs name results files that are not in benchmarks/results/: " + "; ".join(gone)


def test_the_reference_patterns():
    text = (
        "see [x](../recommendation_v4/benchmarks/results/train_h200.md), `results/hot_ids_*.md`, "
        "`train_h100-abc1234.md` and results/convergence_logs/a.report.json; not docs/model.md"
    )
    assert PATH_REFERENCE.findall(text) == ["train_h200.md", "hot_ids_*.md", "convergence_logs/a.report.json"]
    assert "train_h100-abc1234.md" in BARE_REFERENCE.findall(text)
    assert "model.md" not in BARE_REFERENCE.findall(text)
    patterns = _string_patterns('a = f"checkpoint_{gpu}.json"\nb = f"{name}.json"\nc = "scaling"\n')
    assert patterns == {"checkpoint_" + FIELD + r"\.json", "scaling"}
    assert re.fullmatch("checkpoint_" + FIELD + r"\.json", "checkpoint_h200.json")
    assert not re.fullmatch("checkpoint_" + FIELD + r"\.json", "checkpoint_h200-abc1234.json")
