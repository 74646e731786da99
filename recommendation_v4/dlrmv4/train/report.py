"""The run report: ``report.json`` (history, config, schedule, final-parameter digest) and two
plots, ``auc_vs_samples.png`` (against the RCP band of the run's recipe, where the project has one)
and ``throughput_vs_time.png``, in the run directory.

The plots need matplotlib (in both requirement sets); where it is missing the JSON is still
written and the returned list of plots is empty, so a report never fails a finished run.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

import torch

from dlrmv4.files import write_atomically, write_json
from dlrmv4.mlperf.rcp_band import RcpBand

REPORT_FILE = "report.json"
AUC_PLOT = "auc_vs_samples.png"
THROUGHPUT_PLOT = "throughput_vs_time.png"


def parameter_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and bytes of every tensor, in name order: equal digests
    mean bit-identical parameters (a resumed run is compared with an uninterrupted one by it)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def write_report(
    run_dir: Path, report: dict[str, Any], target_auc: float, band: RcpBand | None = None
) -> tuple[Path, list[Path]]:
    """Write the JSON and the plots (the AUC curve against ``band``, the RCP of the run's recipe, where
    there is one); returns (json path, plot paths)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / REPORT_FILE
    write_json(path, {**report, "rcp_band": dataclasses.asdict(band) if band else None})
    return path, _plots(run_dir, report["history"], target_auc, band)


def _plots(run_dir: Path, history: dict[str, Any], target_auc: float, band: RcpBand | None) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    out = []
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    evals = history["evals"]
    ax.plot([e["samples_count"] for e in evals], [e["auc"] for e in evals], marker="o")
    ax.axhline(target_auc, color="grey", linestyle="--", label=f"target {target_auc}")
    if band is not None:  # where the reference runs reached the target: inside it is the references' pace
        ax.axvspan(band.fastest, band.slowest, color="tab:green", alpha=0.15, label=band.label)
        ax.axvline(band.mean, color="tab:green", linewidth=1, label=f"RCP mean {band.mean:,.0f}")
    ax.set(xlabel="train samples", ylabel="eval AUC", title="AUC vs samples")
    ax.legend(loc="upper left", fontsize="small")  # the curve rises to the right
    ax.grid(alpha=0.3)
    out.append(_save(fig, run_dir / AUC_PLOT))
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    points = history["throughput"]
    ax.plot([t for t, _ in points], [r for _, r in points], marker=".")
    ax.set(xlabel="seconds since start", ylabel="train samples/s (per window)", title="Throughput vs time")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    out.append(_save(fig, run_dir / THROUGHPUT_PLOT))
    return out


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    write_atomically(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)
    return path
