"""The reference convergence points of a run's recipe, where the project has them: the band a
run's AUC curve is drawn against at the end (``train/report.py``).

An RCP file (``rcp/rcps_dlrmv4_<preset>.json``, the format of mlperf-logging's ``rcps_dlrmv4.json``)
lists, per global batch size, the samples at which each reference run first reached the target. A
run gets the band of the record made at its own recipe: the same dataset, global batch size and
learning rates; another recipe gets none (its convergence is not the references').
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from dlrmv4.config import BenchmarkConfig

# The repository's rcp/ beside the package (a source checkout; an installed package has none).
RCP_DIR = Path(__file__).resolve().parents[3] / "rcp"


@dataclass(frozen=True)
class RcpBand:
    runs: int  # reference runs that reached the target
    fastest: int  # samples
    slowest: int
    mean: float
    source: str  # the RCP file's name

    @property
    def label(self) -> str:
        return f"RCP ({self.runs} runs): {self.fastest:,}-{self.slowest:,} samples to the target"


def rcp_file(cfg: BenchmarkConfig, rcp_dir: Path = RCP_DIR) -> Path:
    """The project's RCP file for ``cfg``'s dataset (it may not exist)."""
    return rcp_dir / f"rcps_dlrmv4_{cfg.dataset.name}.json"


def rcp_band(cfg: BenchmarkConfig, rcp_dir: Path = RCP_DIR) -> RcpBand | None:
    """The band of the RCP record made at ``cfg``'s recipe, or None."""
    path = rcp_file(cfg, rcp_dir)
    if not path.is_file():
        return None
    train = cfg.train
    for record in json.loads(path.read_text()).values():
        rates = record.get("Hyperparams", {})
        dense = rates.get("opt_base_learning_rate", math.nan)
        sparse = rates.get("opt_sparse_base_learning_rate", dense)  # absent: the tables ran at the dense rate
        same = (
            record.get("BS") == cfg.loader.batch_size
            and math.isclose(dense, train.learning_rate, rel_tol=1e-9)
            and math.isclose(sparse, train.sparse_peak_lr, rel_tol=1e-9)
        )
        points = record.get("Epochs to converge") or []
        if same and points:
            return RcpBand(len(points), min(points), max(points), sum(points) / len(points), path.name)
    return None
