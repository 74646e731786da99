"""The time-to-train projection's measured parts: the all-to-all rate from the hot-ids results and
the exchange's work beyond NCCL from a weak-scaling row (benchmarks/projections/project_time_to_train.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "projections"))

import project_time_to_train as projection
import pytest

NVLINK_GBS, NETWORK_GBS = 300.0, 45.0


def scaling_row(label: str, one_rate: float, two_rate: float, scaling: str = "weak") -> dict:
    def run(world: int, rate: float, repeat: int) -> dict:
        return {
            "world_size": world,
            "global_batch": 1_024 * world,
            "per_rank_batch": 1_024,
            "bare_samples_per_s": rate,
            "mean_history_tokens": 2_800.0,
            "repeat": repeat,
        }

    # Three repeats each; the middle one is the median, the outliers must not count.
    results = [run(1, one_rate * f, i) for i, f in enumerate((0.5, 1.0, 1.2))]
    results += [run(2, two_rate * f, i) for i, f in enumerate((1.3, 1.0, 0.4))]
    return {"label": label, "scaling": scaling, "results": results}


def test_the_exchange_work_is_the_two_rank_steps_extra_time_less_its_nccl_time():
    scaling = {"rows": [scaling_row("other", 10.0, 10.0), scaling_row("gpus", 2_000.0, 2_800.0)]}
    per_sample = projection.exchange_work_per_sample(scaling, "gpus", NVLINK_GBS, NETWORK_GBS)
    one_step, two_step = 1_024 / 2_000.0, 2_048 / 2_800.0
    nccl = projection.alltoall_seconds(2, 1_024, 2_800.0, NVLINK_GBS, NETWORK_GBS)
    assert 0 < nccl < two_step - one_step
    assert per_sample * 1_024 == pytest.approx(two_step - one_step - nccl)


def test_a_two_rank_step_faster_than_its_nccl_time_counts_no_work():
    scaling = {"rows": [scaling_row("gpus", 2_000.0, 4_000.0)]}
    assert projection.exchange_work_per_sample(scaling, "gpus", NVLINK_GBS, NETWORK_GBS) == 0.0


def test_the_exchange_work_comes_from_the_widest_step_the_row_ran():
    row = scaling_row("gpus", 2_000.0, 2_800.0)
    row["results"] += [
        {**r, "world_size": 4, "global_batch": 4_096, "bare_samples_per_s": 4_800.0} for r in row["results"][3:]
    ]
    per_sample = projection.exchange_work_per_sample({"rows": [row]}, "gpus", NVLINK_GBS, NETWORK_GBS)
    one_step, four_step = 1_024 / 2_000.0, 4_096 / 4_800.0
    nccl = projection.alltoall_seconds(4, 1_024, 2_800.0, NVLINK_GBS, NETWORK_GBS)
    assert per_sample * 1_024 == pytest.approx(four_step - one_step - nccl)


@pytest.mark.parametrize(
    "rows, message",
    [
        ([], "no single weak-scaling row labelled 'gpus'"),
        ([scaling_row("gpus", 1.0, 1.0, scaling="strong")], "no single weak-scaling row"),
        (
            [{"label": "gpus", "scaling": "weak", "results": scaling_row("x", 1.0, 1.0)["results"][:3]}],
            "no run on more",
        ),
        ([{"label": "gpus", "scaling": "weak", "results": scaling_row("x", 1.0, 1.0)["results"][3:]}], "no run on 1"),
    ],
)
def test_a_missing_measurement_is_one_clear_error(rows, message):
    with pytest.raises(SystemExit, match=message):
        projection.exchange_work_per_sample({"rows": rows}, "gpus", NVLINK_GBS, NETWORK_GBS)


def test_the_committed_results_project_with_the_exchange_counted():
    """The script's defaults read the committed results: the exchange's work is in both totals."""
    nvlink = projection.measured_alltoall_gbs(projection.load("hot_ids_h100x2"))
    scaling = projection.load("scaling")
    per_sample = projection.exchange_work_per_sample(scaling, "h100x2-torchrec-real-tables", nvlink, NETWORK_GBS)
    with_work = projection.project(
        projection.measured_parts("h200", nvlink, NETWORK_GBS, "hot ids", per_sample, "scaling")
    )
    without = projection.project(projection.measured_parts("h200", nvlink, NETWORK_GBS, "hot ids"))
    for a, b in zip(with_work["rows"], without["rows"]):
        assert a["exchange_work_min"] > 0 and b["exchange_work_min"] == 0
        for total in ("total_min_overlapped", "total_min_not_overlapped"):
            assert a[total] == pytest.approx(b[total] + a["exchange_work_min"])
    assert "permutes and casts at" in projection.table(with_work)
    assert "not counted" in projection.table(without)


def test_distinct_ids_shrink_only_the_history_rows_on_the_wire():
    full = projection.alltoall_seconds(8, 1_024, 2_800.0, NVLINK_GBS, NETWORK_GBS)
    distinct = projection.alltoall_seconds(8, 1_024, 2_800.0, NVLINK_GBS, NETWORK_GBS, history_share=0.01)
    assert distinct / full == pytest.approx((2_800 * 3 * 0.01 + 8) / (2_800 * 3 + 8))


def test_the_committed_results_project_with_distinct_ids():
    """The script's defaults: the 4x H200 row with distinct ids and their share from dedup_ids.json,
    which project a shorter run than the 2x H100 row without them."""
    nvlink = projection.measured_alltoall_gbs(projection.load("hot_ids_h100x2"))
    scaling = projection.load("scaling")
    share = projection.distinct_share(projection.load("dedup_ids"))
    assert 0 < share < 0.01
    dedup = projection.exchange_work_per_sample(
        scaling, "h200x4-torchrec-real-tables-dedup", nvlink, NETWORK_GBS, share
    )
    full = projection.exchange_work_per_sample(scaling, "h100x2-torchrec-real-tables", nvlink, NETWORK_GBS)
    with_dedup = projection.project(
        projection.measured_parts("h200", nvlink, NETWORK_GBS, "hot ids", dedup, "scaling", share)
    )
    without = projection.project(projection.measured_parts("h200", nvlink, NETWORK_GBS, "hot ids", full, "scaling"))
    assert with_dedup["rows"][0]["total_min_not_overlapped"] < without["rows"][0]["total_min_not_overlapped"]
    assert "distinct history ids' rows" in projection.table(with_dedup)


def test_a_labelled_pair_of_measurements_is_projected_on_its_own():
    """--inputs triton: the rehearsal and the train command measured with the portable attention kernels
    (rehearsal_h200_triton, train_h200_triton) set the rates, not the default pair's files."""
    default = projection.measured_parts("h200", NVLINK_GBS, NETWORK_GBS)
    labelled = projection.measured_parts("h200", NVLINK_GBS, NETWORK_GBS, inputs="triton")
    rehearsal, train = projection.load("rehearsal_h200_triton"), projection.load("train_h200_triton")
    assert labelled["rehearsal_rate"] == rehearsal["rehearsal"]["samples_per_s"] != default["rehearsal_rate"]
    assert labelled["eval_rate_per_gpu"] == train["eval_samples_per_s"] != default["eval_rate_per_gpu"]
    with pytest.raises(SystemExit, match="rehearsal_h200_no-such-label.json: run the benchmark"):
        projection.measured_parts("h200", NVLINK_GBS, NETWORK_GBS, inputs="no-such-label")


def test_a_row_and_a_wire_that_disagree_are_refused(monkeypatch):
    monkeypatch.setattr("sys.argv", ["project_time_to_train.py", "--exchange-from", "h100x2-torchrec-real-tables"])
    with pytest.raises(SystemExit, match="ran with dedup_ids False: leave out --distinct-from"):
        projection.main()


def test_a_measured_run_is_projected_with_its_own_shape(tmp_path):
    """--measured-run: the committed synthetic-50m run on four H100s is read back as its own Run (samples,
    batch, evals, windows, its tables' bytes from the sharding plan) and projected on its GPU count."""
    report = projection.RESULTS / "convergence_logs" / "50m_h100x4_seed1.report.json"
    run, world, measured = projection.measured_run(report)
    assert (run.samples, run.global_batch, run.evals, run.eval_samples, world) == (2_219_008, 1_024, 9, 138_513, 4)
    assert 45 < run.table_gib < 50 and run.windows > 100  # 47 GiB of tables at fp32 with Adagrad's row state
    assert measured["total_s"] == pytest.approx(measured["rest_s"] + measured["eval_s"] + measured["checkpoint_s"])
    parts = projection.measured_parts("h100", NVLINK_GBS, NETWORK_GBS)
    row = projection.project_row(parts, run, world)
    assert row["per_gpu_batch"] == 256 and row["per_gpu_samples_per_s"] == parts["small_batch_rate"]
    assert row["eval_min"] * 60 == pytest.approx(9 * 138_513 / (4 * parts["eval_rate_per_gpu"]))
    # The reference run through the same function gives the reference projection's rows.
    assert projection.project(parts)["rows"][0] == projection.project_row(parts, projection.REFERENCE_RUN, 8)


def test_a_measured_run_that_did_not_reach_its_target_is_refused(tmp_path):
    report = tmp_path / "report.json"
    report.write_text('{"history": {"status": "aborted"}}')
    with pytest.raises(SystemExit, match="ended 'aborted', not at its target"):
        projection.measured_run(report)
    with pytest.raises(SystemExit, match="no run report at"):
        projection.measured_run(tmp_path / "missing.json")


def test_delta_checkpoints_save_at_every_window_end_the_disk_allows():
    """8 ranks of 69.9 GiB on a 1 GB/s disk, 440-s windows: the whole save's 600-s write spans the next
    window end (skipped), then a delta of the two windows since, then deltas of one window each; the
    step waits 20 ms per GiB for the whole save and 5 ms per GiB for each delta, and its loop loses
    100 ms per GiB written: the whole rank's block, then 2 % and six times 1 % of it."""
    saves = {"later_s_per_gib": 0.02, "slowdown_s_per_gib": 0.1, "write_gbps": 1.0}
    delta = {"window_share": 0.01, "find_s_per_gib": 0.005}
    waited, skipped = projection.delta_checkpoint_seconds(saves, delta, 8, 9, 440.0, 559.0, 8)
    rank_gib = 559.0 / 8
    assert skipped == 1
    written = rank_gib * (1 + 0.02 + 6 * 0.01)
    assert waited == pytest.approx(rank_gib * 0.02 + 7 * rank_gib * 0.005 + written * 0.1)
    # Every save whole: each 600-s write spans a window end.
    waited, skipped = projection.delta_checkpoint_seconds(saves, delta, 8, 9, 440.0, 559.0, 1)
    assert (skipped, waited) == (4, pytest.approx(5 * rank_gib * (0.02 + 0.1)))


def test_whole_checkpoints_cost_the_wait_and_the_slowdown_of_each_save_made():
    """8 ranks of 69.9 GiB on a 1 GB/s disk, 440-s windows: a 600-s node write, so a save every second
    window end (5 of 9), each costing the copy's wait and the loop's slowdown over the rank's block."""
    saves = {"later_s_per_gib": 0.02, "slowdown_s_per_gib": 0.1, "write_gbps": 1.0}
    seconds = projection.checkpoint_seconds(saves, 1.0, 8, 9, 440.0, 559.0)
    assert seconds == pytest.approx(9 / 2 * 559.0 / 8 * (0.02 + 0.1))
