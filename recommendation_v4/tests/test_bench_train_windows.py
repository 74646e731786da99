"""bench_train.py's profiled windows: the steady one clear of checkpoints, evals and window ends, the
first checkpoint's neighbours, and the loop's rate beside that checkpoint's write."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "step"))

import bench_train

from dlrmv4.data.loader import plan_batches
from dlrmv4.train.schedule import EvalSchedule

BATCH = 32


def events(window_sizes, checkpoint_every, steps, eval_pct=1.0, train_samples=None):
    plan = plan_batches(list(enumerate(window_sizes)), BATCH, drop_last=True)
    schedule = EvalSchedule(train_samples or sum(window_sizes), BATCH, eval_pct)
    return bench_train.loop_events(plan, schedule, checkpoint_every, steps), schedule


def test_the_loops_events_fall_where_the_trainer_makes_them():
    # Windows of 100, 64 and 320 samples at batch 32 (drop_last): 3, 2 and 10 batches.
    found, schedule = events([100, 64, 320], checkpoint_every=4, steps=15, eval_pct=0.5)
    assert found.window_ends == {2, 4, 14}
    assert found.checkpoints == (3, 7, 11)  # not after the last step: that save follows RUN_STOP
    assert found.evals == {p // BATCH - 1 for p in schedule.points(15 * BATCH)}
    assert found.evals  # the schedule names at least one eval inside the run


def test_the_steady_window_ends_before_the_first_checkpoint_and_touches_no_event():
    found, _ = events([32 * 40, 32 * 60], checkpoint_every=30, steps=100)
    quiet, near = bench_train.profile_windows(found, steps=100, earliest=5)
    a, b = quiet
    assert b - a == bench_train.PROFILE_STEPS and b <= found.checkpoints[0] + 1
    assert not any(found.after(s) for s in range(a - 1, b))
    assert near == (29, 29 + bench_train.PROFILE_STEPS)  # from the step the first save follows


def test_a_window_end_inside_the_last_steps_moves_the_steady_window_earlier():
    # A window ends after step 26, three steps before the checkpoint after step 29.
    found, _ = events([32 * 27, 32 * 80], checkpoint_every=30, steps=100)
    quiet, _ = bench_train.profile_windows(found, steps=100, earliest=5)
    assert quiet[1] <= 26  # the step before the window's first is not the window end either
    assert not any(found.after(s) for s in range(quiet[0] - 1, quiet[1]))


def test_without_a_checkpoint_the_steady_window_is_at_the_runs_middle():
    found, _ = events([32 * 200], checkpoint_every=0, steps=100)
    quiet, near = bench_train.profile_windows(found, steps=100, earliest=5)
    assert quiet == (50, 50 + bench_train.PROFILE_STEPS) and near is None


def test_the_checkpoints_window_skips_a_checkpoint_an_eval_follows():
    # An eval follows step 149 as the first checkpoint does (a cadence's multiples meet): that window
    # would hold the eval's kernels, so the next checkpoint's steps are profiled.
    found = bench_train.LoopEvents(
        window_ends=frozenset({500}), evals=frozenset({149, 302}), checkpoints=(149, 299, 449)
    )
    assert bench_train.profile_windows(found, steps=600, earliest=5)[1] == (449, 449 + bench_train.PROFILE_STEPS)
    ends_after = bench_train.LoopEvents(window_ends=frozenset({451}), evals=frozenset(), checkpoints=(449,))
    assert bench_train.profile_windows(ends_after, steps=600, earliest=5)[1] is None


def test_no_quiet_steps_is_one_clear_error():
    found, _ = events([32 * 200], checkpoint_every=6, steps=100)
    with pytest.raises(SystemExit, match="without a checkpoint, an eval or a window end"):
        bench_train.profile_windows(found, steps=100, earliest=5)


def test_the_loops_rate_beside_the_write_against_before_it():
    windows = [  # samples, samples/s: a warm-up window, two steady ones, the save's and the next
        {"samples": 320, "samples_per_s": 100.0},
        {"samples": 640, "samples_per_s": 1_000.0},
        {"samples": 320, "samples_per_s": 1_000.0},
        {"samples": 640, "samples_per_s": 800.0},
        {"samples": 320, "samples_per_s": 400.0},
    ]
    # The first save follows step 39 (1,280 samples: the third window's end); warm-up 320 samples.
    around = bench_train.rates_around_checkpoint(windows, first_save_step=39, batch=BATCH, warmup=320)
    assert around["before"] == pytest.approx(1_000.0)
    assert around["beside"] == pytest.approx(960 / (640 / 800 + 320 / 400))
    assert around["ratio"] == pytest.approx(around["beside"] / 1_000.0)
    assert bench_train.rates_around_checkpoint(windows, first_save_step=200, batch=BATCH, warmup=320) is None


def test_a_profiled_windows_device_time_by_part_and_kernel(tmp_path):
    # Two steps: kernels 0-10 and 12-32 us, a host-to-device copy beside them, a host op left out.
    trace = tmp_path / "steps.json"
    trace.write_text(
        json.dumps(
            {
                "traceEvents": [
                    {"cat": "kernel", "name": "_layer_norm_fwd", "ts": 0, "dur": 10},
                    {"cat": "kernel", "name": "nvjet_sm90_tst_256x152", "ts": 12, "dur": 20},
                    {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 5, "dur": 30},
                    {"cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 40, "dur": 4},
                    {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 3},
                ]
            }
        )
    )
    w = bench_train.window_profile(trace, steps=2)
    assert w["busy"] == pytest.approx(30 / 32)  # kernels only: the gap 10-12 us is idle
    assert w["ms_per_step"] == pytest.approx(32 / 1e3 / 2)
    assert w["parts_ms"]["GEMMs"] == pytest.approx(0.010)
    assert w["parts_ms"]["layer norms"] == pytest.approx(0.005)
    assert w["parts_ms"]["host-device copies"] == pytest.approx(0.015)
    assert w["parts_ms"]["concatenations and copies"] == pytest.approx(0.002)
    assert sum(w["parts_ms"].values()) == pytest.approx((10 + 20 + 30 + 4) / 1e3 / 2)
    assert [k["name"] for k in w["top_kernels"]][:2] == ["Memcpy HtoD (Pinned -> Device)", "nvjet_sm90_tst_256x152"]
    assert all(k["launches_per_step"] == 0.5 for k in w["top_kernels"])
    table = "\n".join(bench_train.step_parts_tables({"profiled_steady": {"steps": [10, 12], **w}}))
    assert "| layer norms | 0.01 | 31.2% |" in table and "| `_layer_norm_fwd` | layer norms |" in table
    assert bench_train.window_profile(tmp_path / "missing.json", steps=2) is None


def test_host_threads_time_inside_ops_by_thread():
    """The training thread is the one that launched the most kernels; nested ops count once; each of
    its costliest CUDA calls names the op that made most of its time (outermost > innermost)."""
    events = [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": 1, "ts": 0, "dur": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": 1, "ts": 5, "dur": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": 2, "ts": 5, "dur": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "tid": 1, "ts": 0, "dur": 4000},
        {"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "tid": 1, "ts": 1000, "dur": 1000},  # inside the first
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "tid": 1, "ts": 6000, "dur": 2000},
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "tid": 2, "ts": 0, "dur": 3000},
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "tid": 3, "ts": 0, "dur": 1000},
    ]
    # A record_function label around the first op (not a torch op: not counted inside ops), and the
    # training thread's waits: one inside both, one outside every op.
    events.append({"ph": "X", "cat": "user_annotation", "name": "[splits_dist]", "tid": 1, "ts": 0, "dur": 5000})
    events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "tid": 1, "ts": 9, "dur": 3000})
    events.append(
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "tid": 1, "ts": 9000, "dur": 1000}
    )
    host = bench_train.host_threads(events, steps=2)
    assert (host["training_ms"], host["others_ms"]) == (3.0, 2.0)
    # The training thread's runtime calls only, costliest first, per step and per call.
    assert host["training_cuda"] == [
        {
            "name": "cudaStreamSynchronize",
            "ms_per_step": 2.0,
            "us_per_call": 2000.0,
            "by": "[splits_dist] > aten::mm",
            "by_share": 0.75,
        },
        {
            "name": "cudaLaunchKernel",
            "ms_per_step": 0.001,
            "us_per_call": 1.0,
            "by": "[splits_dist] > aten::mm",
            "by_share": 1.0,
        },
    ]
    only_outside = bench_train.callers(events[-1:], {"cudaStreamSynchronize"})
    assert only_outside == {"cudaStreamSynchronize": {"(no op)": 1000}}
    steady = {"steps": [10, 15], "host": host}
    near = {"steps": [20, 25], "host": {**host, "training_cuda": host["training_cuda"][1:]}}
    lines = bench_train.cuda_calls_table({"profiled_steady": steady, "profiled_checkpoint": near})
    assert "| call | steps 10-14 | steps 20-24 |" in lines
    assert "| `cudaStreamSynchronize` | 2.0 (2000); 75% `[splits_dist] > aten::mm` | - |" in lines
    assert (
        "| `cudaLaunchKernel` | 0.0 (1); 100% `[splits_dist] > aten::mm` | 0.0 (1); 100% `[splits_dist] > aten::mm` |"
        in lines
    )
    assert bench_train.cuda_calls_table({"profiled_steady": {"steps": [1, 6]}, "profiled_checkpoint": None}) == []
    assert bench_train.host_threads(events[3:], steps=2) is None
