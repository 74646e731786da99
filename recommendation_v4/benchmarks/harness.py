"""What every benchmark shares, so that each result names what was measured, where and how.

- The stamp of a run: the commit (``git_commit``), the machine (``device_facts``), the package
  versions (``package_versions``) and the command as run (``command_line``).
- Timers: ``median_seconds`` (one call per sample), ``window_ms`` (back-to-back calls per sample),
  ``do_bench_ms`` (Triton's do_bench), ``sync``; CUDA events on a GPU, the wall clock on the CPU.
- ``matmul_peak_tflops``: the bf16 matmul rate measured in the same run, the yardstick of MFU.
- The one writer of results: ``write_results`` (``results/<name>.json`` and ``.md``) and
  ``save_labelled_row`` (one file of rows kept by label, each row from its own run).

Torch is imported only inside the functions that need it: the CPU benchmarks (preprocessing,
the sampler, rank balance) run without it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DATASHEET_BF16_TFLOPS = 989.0  # H100/H200 SXM dense bf16
# The model the --smoke modes run: the scripts' paths on any device in seconds.
SMOKE_MODEL = {
    "embedding_dim": 16,
    "d_model": 16,
    "num_layers": 1,
    "num_heads": 1,
    "qk_dim": 16,
    "v_dim": 16,
    "preprocessor_hidden": 16,
    "item_tower_hidden": 16,
    "head_hidden": 16,
    "sequence_dtype": "float32",
    "num_position_buckets": 256,
}
PACKAGES = ("torch", "triton", "fbgemm_gpu", "torchrec", "numpy")  # import names; python comes first


# --- the stamp ---------------------------------------------------------------------------------


@functools.cache
def git_commit() -> str:
    """The commit measured: DLRMV4_COMMIT where the checkout has no .git (a copied tree), else git's."""
    if os.environ.get("DLRMV4_COMMIT"):
        return os.environ["DLRMV4_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_type(device=None) -> str:
    """ "cuda" or "cpu" for a torch.device, a string, or None (a GPU where torch is loaded and sees one)."""
    if device is None:
        torch = sys.modules.get("torch")
        return "cuda" if torch is not None and torch.cuda.is_available() else "cpu"
    return str(device).split(":")[0]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_facts(device=None) -> dict:
    """The machine: CPU model and cores always; on a GPU run also the GPU's name, count, memory and
    compute capability."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    facts = {"cpu": cpu_model(), "cpu_cores": os.cpu_count(), "usable_cores": usable, "platform": platform.platform()}
    if device_type(device) == "cuda":
        import torch

        index = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        facts.update(
            gpu=torch.cuda.get_device_name(index),
            gpu_count=torch.cuda.device_count(),
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            capability=f"{props.major}.{props.minor}",
        )
    return facts


def device_name(device=None) -> str:
    """The device measured, for a table: the GPU's name, or the CPU's model."""
    if device_type(device) == "cuda":
        import torch

        return torch.cuda.get_device_name()
    return cpu_model()


def device_label(facts: dict) -> str:
    """One line for a table: "2x NVIDIA H200" or "AMD EPYC, 2 cores"."""
    if facts.get("gpu"):
        return facts["gpu"] if facts.get("gpu_count", 1) == 1 else f"{facts['gpu_count']}x {facts['gpu']}"
    return f"{facts['cpu']}, {facts['cpu_cores']} cores"


def package_versions() -> dict[str, str]:
    """Python's version and those of torch, triton, fbgemm_gpu, torchrec and numpy where installed (a
    loaded module's own ``__version__`` first: it is the one that ran)."""
    out = {"python": platform.python_version()}
    dists = None
    for name in PACKAGES:
        version = getattr(sys.modules.get(name), "__version__", None)
        if version is None:
            if dists is None:
                dists = importlib.metadata.packages_distributions()
            for dist in dists.get(name, []):  # e.g. fbgemm_gpu comes from fbgemm-gpu or fbgemm-gpu-cpu
                try:
                    version = importlib.metadata.version(dist)
                    break
                except importlib.metadata.PackageNotFoundError:
                    continue
        if version is not None:
            out[name] = str(version)
    return out


# Environment settings that change what is measured, written before the command when set.
MEASURED_ENVIRONMENT = ("PYTORCH_CUDA_ALLOC_CONF",)


def command_line(argv: list[str] | None = None, without: tuple[str, ...] = ()) -> str:
    """``python benchmarks/<group>/<script> <args>`` as this process was started (arguments
    shell-quoted), the same from any working directory. ``without``: options left out with their
    values (where the results go, which is no part of what was measured)."""
    argv = sys.argv if argv is None else argv
    script = Path(argv[0]).resolve().relative_to(HERE).as_posix()
    args, kept = argv[1:], []
    i = 0
    while i < len(args):
        name = args[i].split("=", 1)[0]
        if name in without:
            i += 1 if "=" in args[i] else 2
            continue
        kept.append(args[i])
        i += 1
    settings = [f"{name}={os.environ[name]}" for name in MEASURED_ENVIRONMENT if name in os.environ]
    return shlex.join([*settings, "python", f"benchmarks/{script}", *kept])


def stamp(device=None, command: str | None = None) -> dict:
    """What every result carries: command (this process's unless given), commit, machine
    (``device_facts``) and versions."""
    return {
        "command": command or command_line(),
        "commit": git_commit(),
        "machine": device_facts(device),
        "versions": package_versions(),
    }


def stamp_line(stamped: dict, shown: str = "") -> str:
    """The stamp's parts that ``shown`` does not already carry, as one line ("" if none is missing)."""
    parts = []
    if stamped["command"] not in shown:
        parts.append(f"Command: `{stamped['command']}`")
    if f"commit {stamped['commit']}" not in shown:
        parts.append(f"commit {stamped['commit']}")
    machine = stamped["machine"]
    if (machine.get("gpu") or machine["cpu"]) not in shown:
        parts.append(device_label(machine))
    versions = [f"{name} {v}" for name, v in stamped["versions"].items() if f"{name} {v}" not in shown]
    if versions:
        parts.append(", ".join(versions))
    return "; ".join(parts)


# --- timers ------------------------------------------------------------------------------------


def sync(device) -> None:
    if device_type(device) == "cuda":
        import torch

        torch.cuda.synchronize()


def _seconds(fn: Callable[[], object], on_gpu: bool) -> float:
    """One call of ``fn``: between two CUDA events on a GPU (the device's time), else the wall clock."""
    if on_gpu:
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def median_seconds(fn: Callable[[], object], reps: int, warmup: int = 2) -> float:
    """Median seconds of one call of ``fn`` over ``reps`` calls, after ``warmup`` untimed ones."""
    import torch

    for _ in range(warmup):
        fn()
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.synchronize()
    return float(np.median([_seconds(fn, on_gpu) for _ in range(reps)]))


def window_ms(fn: Callable[[], object], min_ms: float = 40.0, reps: int = 7) -> float:
    """Median per-call milliseconds of back-to-back calls in ``reps`` windows of at least ``min_ms``
    (the host runs ahead as in training; do_bench instead flushes L2 and counts the launch gap before
    every call)."""
    import torch

    on_gpu = torch.cuda.is_available()
    fn()
    sync("cuda" if on_gpu else "cpu")
    started = time.perf_counter()
    fn()
    sync("cuda" if on_gpu else "cpu")
    iters = max(1, int(min_ms / max((time.perf_counter() - started) * 1e3, 1e-3)))

    def window() -> None:
        for _ in range(iters):
            fn()

    return float(np.median([_seconds(window, on_gpu) * 1e3 / iters for _ in range(reps)]))


def do_bench_ms(fn: Callable[[], object], device, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median milliseconds: Triton's do_bench on a GPU (events, L2 flushed before each call); on the
    CPU one untimed call and the median of three."""
    if device_type(device) == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return float(np.median(times)) * 1e3


def matmul_peak_tflops(device, n: int = 8192, reps: int = 20, timer: str = "events") -> float:
    """TFLOP/s of an n x n bf16 matmul on ``device``: ``median_seconds`` of ``reps`` calls (timer
    "events"), or Triton's do_bench median (timer "do_bench": L2 flushed, the launch gap counted)."""
    import torch

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    if timer == "do_bench":
        from triton.testing import do_bench

        seconds = do_bench(lambda: a @ b, return_mode="median") / 1e3
    elif timer == "events":
        seconds = median_seconds(lambda: a @ b, reps)
    else:
        raise ValueError(f"unknown timer {timer!r}")
    return 2 * n**3 / seconds / 1e12


# --- the results files -------------------------------------------------------------------------


def _replace(path: Path, text: str) -> None:
    """Write ``path`` whole (a reader never sees half a file, an interrupted run leaves the old one)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_results(name: str, result: dict, markdown: str, *, device=None, out: Path | str = RESULTS) -> dict:
    """Write ``out/<name>.json`` (``result`` with the run's stamp) and ``out/<name>.md`` (``markdown``
    and a last line with whatever of the stamp it does not already show). Returns the stamped result."""
    stamped = {**result, **stamp(device)}  # the stamp wins: it is what this process ran
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _replace(out / f"{name}.json", json.dumps(stamped, indent=2) + "\n")
    text = markdown.rstrip("\n")
    footer = stamp_line(stamped, text)
    _replace(out / f"{name}.md", text + (f"\n\n{footer}" if footer else "") + "\n")
    return stamped


def save_labelled_row(
    name: str,
    row: dict,
    intro: str,
    table: Callable[[list[dict]], str],
    *,
    device=None,
    out: Path | str = RESULTS,
    command: str | None = None,
) -> dict:
    """Add ``row`` with the run's stamp to ``out/<name>.json`` (replacing an earlier row of its label;
    the other rows keep theirs) and rewrite ``out/<name>.md``: ``intro``, ``table`` of every row, and
    each row's command with its commit, machine and versions. Returns the stamped row."""
    row = {**row, **stamp(device, command)}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    rows = json.loads(path.read_text())["rows"] if path.exists() else []
    rows = [r for r in rows if r["label"] != row["label"]] + [row]
    _replace(path, json.dumps({"rows": rows}, indent=2) + "\n")
    commands = "\n".join(f"- {r['label']}: `{r['command']}`" + _row_stamp(r) for r in rows)
    _replace(out / f"{name}.md", f"{intro}\n\n{table(rows)}\n\nCommands:\n{commands}\n")
    return row


def _row_stamp(row: dict) -> str:
    if "machine" not in row:  # a row written before rows were stamped
        return ""
    versions = ", ".join(f"{name} {v}" for name, v in row["versions"].items())
    return f" (commit {row['commit']}; {device_label(row['machine'])}; {versions})"
