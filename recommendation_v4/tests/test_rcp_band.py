"""The end-of-run AUC plot against the RCP band of the run's recipe (mlperf/rcp_band.py, train/report.py)."""

from __future__ import annotations

import json

import pytest

from dlrmv4.config_loading import load_config
from dlrmv4.mlperf.rcp_band import RcpBand, rcp_band
from dlrmv4.train.report import AUC_PLOT, write_report


def test_a_recipe_with_references_gets_their_band_and_another_none():
    tiny = rcp_band(load_config("synthetic-tiny"))  # GBS 128, LR 3e-3 for both optimizers
    assert tiny is not None and tiny.runs == 20 and tiny.fastest < tiny.mean < tiny.slowest
    assert tiny.source == "rcps_dlrmv4_synthetic-tiny.json"
    medium = rcp_band(load_config("synthetic-medium"))
    assert (medium.runs, medium.fastest, medium.slowest) == (8, 188_928, 251_904)
    # GBS 256 has references at LR 6e-3 only; at the preset's 3e-3 the recipe is another one.
    assert rcp_band(load_config("synthetic-tiny", None, {("loader", "batch_size"): 256})) is None
    scaled = {("loader", "batch_size"): 256, ("train", "learning_rate"): 0.006}
    assert rcp_band(load_config("synthetic-tiny", None, scaled)).runs == 20
    assert rcp_band(load_config("synthetic-tiny", None, {("train", "sparse_learning_rate"): 0.05})) is None
    small = rcp_band(load_config("synthetic-small"))
    assert (small.runs, small.fastest, small.slowest) == (8, 150_528, 458_752)
    assert rcp_band(load_config("synthetic-50m")) is None  # no RCP file for this preset


def test_the_report_draws_the_band_and_records_it(tmp_path):
    pytest.importorskip("matplotlib")
    history = {"evals": [{"samples_count": s, "auc": a} for s, a in ((20_000, 0.6), (60_000, 0.66))],
               "throughput": [(1.0, 100.0), (2.0, 110.0)]}  # fmt: skip
    band = RcpBand(runs=20, fastest=51_072, slowest=102_144, mean=80_012.8, source="rcps_dlrmv4_synthetic-tiny.json")
    pngs = {}
    for name, with_band in (("with", band), ("without", None)):
        report, plots = write_report(tmp_path / name, {"history": history}, 0.65, with_band)
        assert json.loads(report.read_text())["rcp_band"] == (
            None if with_band is None else {**band.__dict__, "mean": 80_012.8}
        )
        pngs[name] = (tmp_path / name / AUC_PLOT).read_bytes()
        assert AUC_PLOT in [p.name for p in plots] and pngs[name].startswith(b"\x89PNG")
    assert pngs["with"] != pngs["without"]
