"""The holdout's quality bounds in a store's meta.json: the ceiling from the generator's true
probabilities and the simple baseline, their AUC, and the signal they rest on at every size."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from dlrmv4.config_loading import load_config
from dlrmv4.data import synthetic
from dlrmv4.data.holdout_ceiling import holdout_ceiling, holdout_truth
from dlrmv4.data.preprocess import preprocess
from dlrmv4.data.rank_auc import rank_auc
from dlrmv4.data.store import open_store
from dlrmv4.data.yambda_schema import LISTEN
from dlrmv4.errors import UserError
from dlrmv4.train.metrics import exact_auc

# Where the generator's signal sits: the AUC of its true probabilities over the listens an anchor could be.
SIGNAL_BAND = (0.78, 0.84)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The embedded default's raw files and store (the truth file beside the events)."""
    cfg = load_config("synthetic-tiny")
    root = tmp_path_factory.mktemp("tiny")
    raw = synthetic.generate(root / "raw", "tiny", cfg.dataset.synthetic_seed, progress=False)
    out = root / "processed" / "synthetic-tiny"
    meta = preprocess(raw, out, cfg.dataset, cfg.preprocess, progress=False, truth=synthetic.truth_path(raw))
    return cfg, raw, out, meta


def test_rank_auc_is_the_trainers_auc():
    """Ties counted half, as the device AUC counts them; undefined with one class."""
    rng = np.random.default_rng(3)
    scores = rng.integers(0, 40, 5_000).astype(np.float64)  # many ties
    labels = rng.random(5_000) < 1 / (1 + np.exp(-(scores - 20) / 8))
    expected = exact_auc(torch.from_numpy(scores), torch.from_numpy(labels.astype(np.float64)))
    assert rank_auc(scores, labels) == pytest.approx(expected, abs=1e-12)
    assert rank_auc(np.array([1.0, 2.0, 3.0]), np.array([0, 1, 1])) == 1.0
    assert rank_auc(np.array([3.0, 2.0, 1.0]), np.array([0, 1, 1])) == 0.0
    assert rank_auc(np.ones(4), np.array([0, 1, 0, 1])) == 0.5
    assert rank_auc(np.arange(3.0), np.ones(3)) is None


def test_the_store_records_its_ceiling_and_baseline(tiny):
    cfg, raw, out, meta = tiny
    quality = json.loads((out / "meta.json").read_text())["quality"]
    assert quality == meta["quality"]
    assert quality["eval_samples"] == meta["counts"]["eval_samples"]
    lo, hi = SIGNAL_BAND
    assert lo <= quality["ceiling_auc"] <= hi, quality
    assert quality["ceiling"] == "the generator's true listen_plus probabilities"
    # The baseline finds most of the signal, never more than the best possible score.
    assert 0.70 <= quality["baseline_auc"] < quality["ceiling_auc"], quality
    assert "fitted on 135,239 train-window anchors" in quality["baseline"]


def test_the_ceiling_scores_each_anchor_with_its_own_probability(tiny):
    """Each holdout anchor gets its own raw row's probability: the store's labels follow them (the
    mean probability matches the label rate), and the same probabilities in another order lose the signal."""
    cfg, raw, out, _ = tiny
    store = open_store(out)
    truth = holdout_truth(store, raw.multi_event, synthetic.truth_path(raw), cfg.preprocess)
    anchors = np.asarray(store.window_anchors(store.num_windows - 1))
    labels = np.asarray(store.train.action[anchors]) == 1
    assert abs(truth.mean() * (1 - 0.005) - labels.mean()) < 4 * np.sqrt(labels.mean() / len(labels))
    shuffled = rank_auc(np.random.default_rng(0).permutation(truth), labels)
    assert abs(shuffled - 0.5) < 0.03
    assert holdout_ceiling(store, raw.multi_event, synthetic.truth_path(raw), cfg.preprocess) == pytest.approx(
        rank_auc(truth, labels)
    )


def test_a_truth_file_that_does_not_line_up_is_refused(tiny, tmp_path):
    """Probabilities of other rows (here: the rows shifted by one) stop with one line, not a wrong ceiling."""
    cfg, raw, out, _ = tiny
    table = pq.read_table(synthetic.truth_path(raw))
    values = table.column(0).to_numpy()
    shifted = tmp_path / "shifted.parquet"
    pq.write_table(
        table.set_column(0, table.schema.field(0), [np.roll(values, 1)]),
        shifted,
        row_group_size=synthetic.ROW_GROUP_ROWS,
    )
    store = open_store(out)
    with pytest.raises(UserError, match="does not line up"):
        holdout_truth(store, raw.multi_event, shifted, cfg.preprocess)
    regrouped = tmp_path / "regrouped.parquet"
    pq.write_table(table, regrouped, row_group_size=1000)
    with pytest.raises(UserError, match="row groups do not match"):
        holdout_truth(store, raw.multi_event, regrouped, cfg.preprocess)


def test_no_ceiling_without_the_generators_truth_or_with_another_label(tiny, tmp_path):
    """Real data has no truth, raw data written without it has none either; labels at another listen
    threshold are not what the probabilities describe. Every store still gets its baseline."""
    cfg, raw, _, _ = tiny
    real = preprocess(raw, tmp_path / "real", cfg.dataset, cfg.preprocess, progress=False, truth=None)["quality"]
    assert real["ceiling_auc"] is None and real["ceiling"] == "real data: no generator's truth"
    assert real["baseline_auc"] > 0.7
    absent = preprocess(raw, tmp_path / "absent", cfg.dataset, cfg.preprocess, progress=False, truth=tmp_path / "none")
    assert absent["quality"]["ceiling_auc"] is None and "no none beside the events" in absent["quality"]["ceiling"]
    other = dataclasses.replace(cfg.preprocess, listen_threshold_pct=80)
    moved = preprocess(raw, tmp_path / "t80", cfg.dataset, other, progress=False, truth=synthetic.truth_path(raw))
    assert moved["quality"]["ceiling_auc"] is None
    assert "played_ratio_pct >= 50" in moved["quality"]["ceiling"] and ">= 80" in moved["quality"]["ceiling"]


@pytest.mark.parametrize(
    "size, users",
    [
        ("tiny", 300),
        ("small", 1000),
        ("medium", 1000),
        ("50m", 300),
        pytest.param("1b", 3000, marks=pytest.mark.slow),  # its catalog (9.4 M items) takes seconds
        pytest.param("5b", 600, marks=pytest.mark.slow),
    ],
)
def test_every_size_carries_the_signal(size, users):
    """The AUC of the true probabilities over the listens past the preset's min_history, for a sample
    of each size's users, stays inside the band: a change to the generator cannot quietly remove the
    signal at one size (the sizes differ in their catalogs, users and spans)."""
    cfg = load_config(f"synthetic-{size}")
    events = synthetic.users_events(size, cfg.dataset.synthetic_seed, range(users))
    uid = events["uid"].astype(np.int64)
    starts = np.r_[0, np.flatnonzero(np.diff(uid)) + 1]
    index = np.arange(len(uid))
    local = index - starts[np.searchsorted(starts, index, side="right") - 1]
    candidates = (events["event_type"] == LISTEN) & (local >= cfg.preprocess.min_history)
    labels = (events["played_ratio_pct"] >= 50) & ~events["ratio_null"]
    assert candidates.sum() > 100_000
    auc = rank_auc(events[synthetic.TRUTH_COLUMN][candidates], labels[candidates])
    assert SIGNAL_BAND[0] <= auc <= SIGNAL_BAND[1], (size, auc)
    assert np.isnan(events[synthetic.TRUTH_COLUMN][events["event_type"] != LISTEN]).all()


def test_users_events_are_the_generated_rows(tiny):
    """users_events gives the very rows generate wrote for those users (the band test reads them)."""
    cfg, raw, _, _ = tiny
    table = pq.read_table(raw.multi_event)
    truth = pq.read_table(synthetic.truth_path(raw)).column(0).to_numpy()
    first = synthetic.users_events("tiny", cfg.dataset.synthetic_seed, range(0, 5))
    n = len(first["uid"])
    assert np.array_equal(table.column("uid").to_numpy()[:n], first["uid"])
    assert np.array_equal(table.column("item_id").to_numpy()[:n], first["item_id"])
    assert np.array_equal(truth[:n], first[synthetic.TRUTH_COLUMN], equal_nan=True)
    with pytest.raises(UserError, match="outside the 300 users"):
        synthetic.users_events("tiny", 1, range(290, 301))
