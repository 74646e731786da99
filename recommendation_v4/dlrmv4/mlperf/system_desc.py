"""A submission's system description, ``systems/<name>.json``: drafted from what this machine reports,
checked with mlperf-logging's ``system_desc_checker``.

The machine tells its host processors (model, sockets, cores, threads, frequency, caches), memory,
the run directory's file system size, its accelerators (model, count, memory, clock and host link
where ``nvidia-smi`` answers) and the software (PyTorch and the stack under it, the operating
system). What it cannot tell (the submitter, division and availability status, interconnects and
topologies, memory configurations, cooling, notes) is written as an empty string and named in the
report, so the checker's verdict and the fields left to fill are both said, not hidden. A file that
exists is never written over: the submitter's edits stay, and it is checked as it is.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from dlrmv4.errors import UserError
from dlrmv4.files import write_atomically
from dlrmv4.mlperf.rules import RULESET

USAGE = "training"
# The fields system_desc_checker requires (mlperf-logging 4.1), in its order.
REQUIRED_FIELDS = (
    "submitter",
    "division",
    "status",
    "system_name",
    "number_of_nodes",
    "host_processors_per_node",
    "host_processor_model_name",
    "host_processor_core_count",
    "host_processor_vcpu_count",
    "host_processor_frequency",
    "host_processor_caches",
    "host_processor_interconnect",
    "host_memory_capacity",
    "host_storage_type",
    "host_storage_capacity",
    "host_networking",
    "host_networking_topology",
    "host_memory_configuration",
    "accelerators_per_node",
    "accelerator_model_name",
    "accelerator_host_interconnect",
    "accelerator_frequency",
    "accelerator_on-chip_memories",
    "accelerator_memory_configuration",
    "accelerator_memory_capacity",
    "accelerator_interconnect",
    "accelerator_interconnect_topology",
    "cooling",
    "hw_notes",
    "framework",
    "other_software_stack",
    "operating_system",
    "sw_notes",
)
# The software whose versions the description names, as (distribution, how it is written).
STACK = (
    ("triton", "Triton"),
    ("fbgemm_gpu", "FBGEMM-GPU"),
    ("torchrec", "TorchRec"),
    ("mlperf-logging", "mlperf-logging"),
)


@dataclass(frozen=True)
class SystemDescReport:
    path: Path
    written: bool  # False: the file was there already and is kept as it was
    to_fill: list[str]  # required fields that are empty (or missing) in the file
    checker_passed: bool
    checker_problems: list[str]  # the checker's own reasons, as it logs them


def systems_dir(results_dir: Path, system: str, run_dir: Path) -> Path:
    """``<submission>/systems`` beside ``<submission>/results/<system>/dlrmv4`` (the default layout); the
    run directory's ``systems`` when the results folder is laid out otherwise."""
    results_dir = results_dir.resolve()
    if results_dir.name == "dlrmv4" and results_dir.parent.name == system and results_dir.parents[1].name == "results":
        return results_dir.parents[2] / "systems"
    return run_dir / "systems"


def _cpuinfo() -> list[dict[str, str]]:
    """/proc/cpuinfo's processors as dicts (empty where the file is not there)."""
    with contextlib.suppress(OSError):
        blocks = Path("/proc/cpuinfo").read_text().strip().split("\n\n")
        return [
            {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in block.splitlines())}
            for block in blocks
        ]
    return []


def _sys_text(path: str) -> str:
    with contextlib.suppress(OSError):
        return Path(path).read_text().strip()
    return ""


def _caches() -> str:
    """cpu0's caches from sysfs: "L1d 48K, L1i 32K, L2 2048K, L3 107520K"."""
    found = []
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        level, kind, size = (_sys_text(str(index / name)) for name in ("level", "type", "size"))
        if level and size:
            suffix = {"Data": "d", "Instruction": "i"}.get(kind, "")
            found.append(f"L{level}{suffix} {size}")
    return ", ".join(found)


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:,.0f} GiB" if n_bytes >= 10 * 2**30 else f"{n_bytes / 2**30:.1f} GiB"


def host_facts(run_dir: Path) -> dict[str, str]:
    """The host's processors, memory and the run directory's file system, as this machine reports them."""
    cpus = _cpuinfo()
    sockets = {c.get("physical id", "0") for c in cpus} or {"0"}
    cores = {(c.get("physical id", "0"), c.get("core id", c.get("processor", ""))) for c in cpus}
    max_khz = _sys_text("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq")
    if max_khz.isdigit():
        frequency = f"{int(max_khz) / 1000:.0f} MHz (maximum)"
    else:
        mhz = cpus[0].get("cpu MHz", "") if cpus else ""
        frequency = f"{float(mhz):.0f} MHz (as read)" if mhz else ""
    memory = ""
    meminfo = _sys_text("/proc/meminfo")
    found = re.search(r"^MemTotal:\s+(\d+) kB", meminfo, re.M)
    if found:
        memory = _gib(int(found.group(1)) * 1024)
    storage = ""
    with contextlib.suppress(OSError):
        probe = run_dir if run_dir.exists() else Path.cwd()
        storage = f"{_gib(shutil.disk_usage(probe).total)} (the file system of {run_dir})"
    return {
        "host_processors_per_node": str(len(sockets)),
        "host_processor_model_name": (cpus[0].get("model name", "") if cpus else "") or platform.processor(),
        "host_processor_core_count": str(len(cores) // len(sockets)) if cores else "",
        "host_processor_vcpu_count": str(os.cpu_count() or ""),
        "host_processor_frequency": frequency,
        "host_processor_caches": _caches(),
        "host_memory_capacity": memory,
        "host_storage_capacity": storage,
    }


def _nvidia_smi(query: str) -> str:
    """The first GPU's answer to ``nvidia-smi --query-gpu=QUERY`` ("" where there is none)."""
    if shutil.which("nvidia-smi") is None:
        return ""
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    first = out.strip().splitlines()
    return first[0].strip() if first else ""


def accelerator_facts() -> dict[str, str]:
    """The node's accelerators as torch (and ``nvidia-smi``, for clock and host link) report them;
    "0" and "N/A" on a machine without one."""
    import torch

    if not torch.cuda.is_available():
        fields = [f for f in REQUIRED_FIELDS if f.startswith("accelerator_")]
        return {"accelerators_per_node": "0", **dict.fromkeys(fields, "N/A (no accelerator on this machine)")}
    props = torch.cuda.get_device_properties(0)
    clock = _nvidia_smi("clocks.max.sm")
    link = _nvidia_smi("pcie.link.gen.max,pcie.link.width.max")
    gen, _, width = link.partition(",")
    return {
        "accelerators_per_node": str(torch.cuda.device_count()),
        "accelerator_model_name": torch.cuda.get_device_name(0),
        "accelerator_host_interconnect": f"PCIe Gen{gen.strip()} x{width.strip()}" if width.strip() else "",
        "accelerator_frequency": f"{clock} MHz" if clock.isdigit() else "",
        "accelerator_memory_capacity": _gib(props.total_memory),
    }


def software_facts() -> dict[str, str]:
    import torch

    stack = [f"Python {platform.python_version()}"]
    if torch.version.cuda:
        stack.append(f"CUDA {torch.version.cuda}")
    if torch.version.hip:
        stack.append(f"ROCm {torch.version.hip}")
    with contextlib.suppress(Exception):
        if torch.backends.cudnn.is_available():
            stack.append(f"cuDNN {torch.backends.cudnn.version()}")
    with contextlib.suppress(Exception):
        if torch.cuda.is_available():
            stack.append("NCCL " + ".".join(map(str, torch.cuda.nccl.version())))
    for dist, name in STACK:
        with contextlib.suppress(metadata.PackageNotFoundError):
            stack.append(f"{name} {metadata.version(dist)}")
    os_name = platform.system()
    with contextlib.suppress(OSError, AttributeError):
        os_name = platform.freedesktop_os_release()["PRETTY_NAME"]
    return {
        "framework": f"PyTorch {torch.__version__}",
        "other_software_stack": ", ".join(stack),
        "operating_system": f"{os_name}, kernel {platform.release()}",
    }


def draft(system: str, nodes: int, run_dir: Path) -> dict[str, str]:
    """Every required field: what this machine reports, "" for what only the submitter knows."""
    known = {
        "system_name": system,
        "number_of_nodes": str(nodes),
        **host_facts(run_dir),
        **accelerator_facts(),
        **software_facts(),
    }
    return {field: known.get(field, "") for field in REQUIRED_FIELDS}


def empty_fields(desc: dict[str, Any]) -> list[str]:
    """The required fields missing from ``desc`` or left as an empty string, in the checker's order."""
    return [f for f in REQUIRED_FIELDS if str(desc.get(f, "")).strip() == ""]


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage().strip())


def run_checker(path: Path) -> tuple[bool, list[str]]:
    """mlperf-logging's system_desc_checker on ``path`` (training, the project's ruleset): its verdict and
    the reasons it logs."""
    from mlperf_logging.system_desc_checker.system_desc_checker import check_system_desc

    collect = _Collect()
    root = logging.getLogger()
    root.addHandler(collect)
    try:
        valid = check_system_desc(str(path), USAGE, RULESET)[0]
    finally:
        root.removeHandler(collect)
    return bool(valid), collect.messages


def write_system_desc(directory: Path, system: str, nodes: int, run_dir: Path) -> SystemDescReport:
    """Draft ``directory/<system>.json`` unless it exists, then check it."""
    path = directory / f"{system}.json"
    written = not path.exists()
    if written:
        directory.mkdir(parents=True, exist_ok=True)
        # In the checker's order (write_json would sort the keys).
        text = json.dumps(draft(system, nodes, run_dir), indent=2) + "\n"
        write_atomically(path, lambda tmp: tmp.write_text(text))
    try:
        desc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: not a readable JSON system description ({exc})") from None
    passed, problems = run_checker(path)
    return SystemDescReport(path, written, empty_fields(desc), passed, problems)


def describe(report: SystemDescReport) -> list[str]:
    """The report's lines: the file, the fields left to fill, the checker's verdict."""
    how = "drafted from this machine" if report.written else "kept as it was"
    version = metadata.version("mlperf-logging")
    lines = [f"system description {report.path} ({how})"]
    if report.to_fill:
        lines.append(f"{len(report.to_fill)} fields for the submitter to fill: {', '.join(report.to_fill)}")
    verdict = "passed" if report.checker_passed else "failed: " + "; ".join(report.checker_problems or ["-"])
    lines.append(f"system_desc_checker (mlperf-logging {version}, {USAGE} {RULESET}): {verdict}")
    return lines
