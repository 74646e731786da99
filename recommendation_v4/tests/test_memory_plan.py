"""The memory plan: the reference recipe on 8 GPUs of four sizes, refusals, fixed choices, and the
start-of-run check (TorchRec's real planner, no GPU needed)."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest

from dlrmv4.cli import main
from dlrmv4.config_loading import load_config
from dlrmv4.data.hashing import table_rows
from dlrmv4.model.embeddings.torchrec_backend.sharding import parse_table_options, target_plan
from dlrmv4.plan.activations import (
    MEASURED_BYTES_PER_TOKEN,
    ActivationShape,
    kept_bytes_per_token,
    stu_kept_bytes_per_token,
)
from dlrmv4.plan.costs import GIB, chunk_efficiency
from dlrmv4.plan.explain import describe, refusal
from dlrmv4.plan.machine import plan_for_config
from dlrmv4.plan.resolve import resolved_config
from dlrmv4.plan.search import make_memory_plan
from dlrmv4.reference_counts import YAMBDA_5B_TABLE_COUNTS

BASE = ("item", "artist", "album", "uid")
CROSSES = ("user_artist", "user_album", "user_hour", "item_hour", "artist_hour", "user_organic", "user_artist_hour")
REFERENCE = [
    "--preset",
    "yambda-5b",
    "--plan-world-size",
    "8",
    "--plan-host-memory-gib",
    "2048",
    "--plan-disk-gib",
    "4096",
]


def _cfg(tmp_path, preset="yambda-5b", **values):
    overrides = {("dataset", "data_path"): str(tmp_path / "data")}
    overrides.update({tuple(k.split("__")): v for k, v in values.items()})
    return load_config(preset, None, overrides)


def _reference_plan(tmp_path, gib: float, **values):
    return plan_for_config(
        _cfg(
            tmp_path,
            plan__plan_world_size=8,
            plan__plan_host_memory_gib=2048.0,
            plan__plan_disk_gib=4096.0,
            plan__plan_device_memory_gib=gib,
            **values,
        )
    )


def _main(capsys, *args):
    code = main([*args, "--no-progress"])
    out, err = capsys.readouterr()
    return code, out, err


def _all_hbm_table_bytes(cfg) -> int:
    """Per rank: every table row-split over 8 ranks (the first shards take the ceiling), fp32 rows
    of 512 + one fp32 Adagrad value per row."""
    rows = list(YAMBDA_5B_TABLE_COUNTS) + list(table_rows(cfg.sampler))
    return sum(math.ceil(r / 8) * (512 * 4 + 4) for r in rows)


@pytest.mark.parametrize("gib", [80, 141, 180, 288])
def test_reference_recipe_fits_8_gpus(tmp_path, capsys, gib):
    code, out, err = _main(
        capsys, "plan", *REFERENCE, "--plan-device-memory-gib", str(gib), "--data-path", str(tmp_path / "data")
    )
    assert code == 0, err
    assert "verdict: fits" in out and "8 processes" in out and "1,024 samples per process" in out
    plan = _reference_plan(tmp_path, gib)
    assert plan.fits and plan.backend == "torchrec" and plan.candidate.device_total <= gib * GIB
    placement = {u.name: u.placement for u in plan.tables}
    assert all(placement[n] == "hbm" for n in BASE)
    if gib == 80:
        moved = [n for n in CROSSES if placement[n] == "uvm"]
        assert moved and moved[0] == "user_artist"  # the largest moves first
        assert f"{'user_artist':<18}{100_000_000:>13,}  {'uvm':<12}" in out
    else:
        assert set(placement.values()) == {"hbm"}
        table_bytes = _all_hbm_table_bytes(plan_cfg := _cfg(tmp_path))
        assert sum(u.device_bytes for u in plan.tables) == table_bytes
        assert 69.9 < table_bytes / GIB < 70.1
        assert f"{table_bytes / GIB:,.2f}" in out.split("all tables")[1].splitlines()[0]
        # Looked-up rows: 1,024 x (3 x 4,087 history + 3 candidates + 8 contextual) rows of 512 bf16.
        rows = 1024 * (3 * (plan_cfg.sampler.max_seq_len - 9) + 3 + 8)
        assert f"looked-up rows, bfloat16 ({rows:,} rows x 512)" in out
        assert f"{rows * 512 * 2 / GIB:,.2f} GiB" in out


def test_resolved_config_is_what_the_runs_planner_accepts(tmp_path):
    plan = _reference_plan(tmp_path, 80)
    cfg = resolved_config(plan, _cfg(tmp_path))
    assert cfg.train.chunks == plan.chunks >= 1 and cfg.model.recompute == plan.recompute != "auto"
    emb = cfg.embeddings
    placement = parse_table_options(emb.placement, "placement", ("hbm", "uvm", "uvm_caching"))
    sharding = parse_table_options(emb.sharding_types, "sharding_types", ("row_wise", "column_wise", "table_wise"))
    assert placement["user_artist"] == "uvm" and placement["item"] == "hbm" and set(sharding.values()) == {"row_wise"}
    assert 0 < emb.hbm_cap_gib < 80
    # The cap leaves the tables in HBM room on the run's planner: it finds the same layout.
    rows = {u.name: u.rows for u in plan.tables}
    layout = target_plan(
        rows,
        512,
        sharding,
        placement,
        world_size=8,
        local_world_size=8,
        compute_device="cuda",
        hbm_cap_bytes=int(emb.hbm_cap_gib * GIB),
        ddr_cap_bytes=1 << 50,
    )
    assert layout is not None


def test_fixed_chunks_and_recompute_are_honoured(tmp_path):
    plan = _reference_plan(tmp_path, 180, train__chunks=7, model__recompute="cheap")
    assert plan.fits and (plan.chunks, plan.recompute) == (7, "cheap")
    assert plan.candidate.activations.samples == math.ceil(1024 / 7)
    cfg = resolved_config(plan, _cfg(tmp_path, train__chunks=7, model__recompute="cheap"))
    assert (cfg.train.chunks, cfg.model.recompute) == (7, "cheap")
    # Only the recompute mode fixed: the plan picks the chunks for that mode.
    layer = _reference_plan(tmp_path, 180, model__recompute="layer")
    assert layer.recompute == "layer" and layer.chunks >= 1


def test_a_fixed_choice_that_does_not_fit_names_its_knob(tmp_path):
    plan = _reference_plan(tmp_path, 141, train__chunks=1, model__recompute="none")
    assert not plan.fits
    line = refusal(plan)
    assert "\n" not in line and "--chunks 0" in line and "--recompute layer" in line


def test_all_tables_in_hbm_on_80_gib_is_refused_in_one_line():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dlrmv4",
            "plan",
            *REFERENCE,
            "--plan-device-memory-gib",
            "80",
            "--placement",
            "*=hbm",
            "--data-path",
            "/nonexistent/data",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith("[dlrmv4] error: the memory plan does not fit: yambda-5b needs ")
    assert "the largest consumer: tables in HBM (fp32 rows + row-wise Adagrad state), 70.01 GiB" in line
    assert "--plan-world-size 16" in line and "--placement 'user_artist=uvm_caching," in line
    assert "verdict: does not fit" in proc.stdout


def test_one_16_gib_gpu_is_refused_naming_the_replicated_tables(tmp_path, capsys):
    code, out, err = _main(
        capsys,
        "plan",
        "--preset",
        "yambda-5b",
        "--plan-world-size",
        "1",
        "--plan-device-memory-gib",
        "16",
        "--plan-host-memory-gib",
        "2048",
        "--data-path",
        str(tmp_path / "data"),
    )
    assert code == 1 and err.count("\n") == 1
    assert "largest consumer: tables, a replica of each on every process (plain backend" in err
    assert "--embedding-backend torchrec with " in err
    code, out, err = _main(
        capsys,
        "plan",
        "--preset",
        "yambda-5b",
        "--plan-world-size",
        "1",
        "--plan-device-memory-gib",
        "16",
        "--plan-host-memory-gib",
        "2048",
        "--embedding-backend",
        "torchrec",
        "--data-path",
        str(tmp_path / "data"),
    )
    assert code == 1 and err.count("\n") == 1 and "largest consumer: looked-up rows" in err


def test_host_memory_too_small_for_the_moved_tables(tmp_path, capsys):
    code, _, err = _main(
        capsys,
        "plan",
        *REFERENCE[:4],
        "--plan-host-memory-gib",
        "128",
        "--plan-device-memory-gib",
        "80",
        "--data-path",
        str(tmp_path / "data"),
    )
    assert code == 1 and err.count("\n") == 1
    assert "of host memory per node of 128.00 GiB" in err and "user_artist" in err


@pytest.mark.parametrize(
    "flag, value, shown",
    [
        ("--plan-world-size", "-1", "plan.plan_world_size=-1"),
        ("--plan-device-memory-gib", "-80", "plan.plan_device_memory_gib=-80.0"),
        ("--plan-host-memory-gib", "-1", "plan.plan_host_memory_gib=-1.0"),
        ("--plan-gpus-per-node", "-8", "plan.plan_gpus_per_node=-8"),
        ("--plan-headroom-fraction", "0.95", "plan.plan_headroom_fraction=0.95"),
    ],
)
def test_invalid_plan_flags_are_refused(capsys, flag, value, shown):
    code, _, err = _main(capsys, "plan", "--preset", "yambda-5b", f"{flag}={value}")
    assert code == 1 and err.count("\n") == 1
    assert err.startswith(f"[dlrmv4] error: config field {shown} is outside the allowed range")


def test_uneven_batch_and_unsized_tables_are_one_line(tmp_path, capsys):
    code, _, err = _main(
        capsys,
        "plan",
        *REFERENCE[:2],
        "--plan-world-size",
        "3",
        "--plan-device-memory-gib",
        "80",
        "--data-path",
        str(tmp_path / "data"),
    )
    assert code == 1 and "does not split evenly over 3 processes" in err and err.count("\n") == 1
    code, _, err = _main(capsys, "plan", "--preset", "synthetic-small", "--data-path", str(tmp_path / "data"))
    assert code == 1 and err.count("\n") == 1 and "prepare the data" in err and "--item-rows" in err


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    data = tmp_path_factory.mktemp("plan") / "data"
    assert main(["prepare", "--data-path", str(data), "--no-progress"]) == 0
    return data


def test_tiny_preset_on_the_cpu_fits_unchunked(tiny_data):
    cfg = load_config("synthetic-tiny", None, {("dataset", "data_path"): str(tiny_data)})
    plan = plan_for_config(cfg)
    assert plan.target.device_kind == "cpu" and plan.backend == "plain"
    assert plan.fits and (plan.chunks, plan.recompute) == (1, "none")
    resolved = resolved_config(plan, cfg)
    assert (resolved.train.chunks, resolved.model.recompute) == (1, "none")
    assert resolved.embeddings == cfg.embeddings  # the plain backend takes no TorchRec settings


def test_train_stops_before_the_mlperf_log_when_the_plan_does_not_fit(tiny_data, tmp_path, capsys):
    run_dir = tmp_path / "run"
    code, out, err = _main(
        capsys, "train", "--data-path", str(tiny_data), "--run-dir", str(run_dir), "--plan-device-memory-gib", "0.001"
    )
    assert code == 1
    assert err.count("\n") == 1 and err.startswith("[dlrmv4] error: the memory plan does not fit: synthetic-tiny")
    assert "memory plan for synthetic-tiny" in out
    assert not (run_dir / "mlperf_log.txt").exists()


def test_train_stops_before_the_mlperf_log_when_a_whole_checkpoint_does_not_fit_the_disk(tiny_data, tmp_path, capsys):
    """A disk of 1 KiB (--plan-disk-gib): refused in one line before the MLPerf log; the same run that
    writes no checkpoint trains."""
    run_dir = tmp_path / "run"
    args = ["train", "--data-path", str(tiny_data), "--run-dir", str(run_dir), "--plan-disk-gib", str(1 / 2**20)]
    code, out, err = _main(capsys, *args)
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith(
        "[dlrmv4] error: the run's checkpoints do not fit its disk: a whole checkpoint of this run is "
    )
    assert f"GiB, but the run directory {run_dir} has 0.00 GiB free; to fit: " in err
    assert "--checkpoint-every-window false --final-checkpoint false (it cannot be resumed)" in err
    assert not (run_dir / "mlperf_log.txt").exists()
    code, out, err = _main(
        capsys, *args, "--checkpoint-every-window", "false", "--final-checkpoint", "false", "--max-steps", "2"
    )
    assert code == 0, err
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())


def test_chunk_efficiency_follows_the_measured_curve():
    assert chunk_efficiency(256) == chunk_efficiency(1024) == 1.0
    assert chunk_efficiency(128) == pytest.approx(1755 / 1723)
    assert chunk_efficiency(64) == pytest.approx(1755 / 1626)
    assert chunk_efficiency(32) == pytest.approx(1755 / 1132)
    assert chunk_efficiency(16) == pytest.approx(2 * 1755 / 1132)
    assert chunk_efficiency(32) > chunk_efficiency(45) > chunk_efficiency(64)


def test_per_token_constants_and_the_measured_override(monkeypatch):
    shape = ActivationShape.from_config(load_config("yambda-5b").model)
    # D 512, 4 heads of 128, bf16, dropout on (docs/model.md).
    assert stu_kept_bytes_per_token(shape, "none") == 1024 + 1024 + 4096 + 1024 + 3072 + 512 + 16
    assert stu_kept_bytes_per_token(shape, "cheap") == 1024 + 1024 + 8  # x, attn, the input norm's statistics
    assert stu_kept_bytes_per_token(shape, "layer") == 1024
    monkeypatch.setitem(MEASURED_BYTES_PER_TOKEN, shape.key("cheap"), 12_345.0)
    assert kept_bytes_per_token(shape, "cheap", 4096, 8) == 12_345.0
    assert kept_bytes_per_token(shape, "none", 4096, 8) != 12_345.0


def test_make_memory_plan_is_pure_and_explicit(tmp_path):
    cfg = _cfg(tmp_path)
    plan = make_memory_plan(
        cfg,
        world_size=8,
        gpus_per_node=8,
        device_kind="cuda",
        device_memory_bytes=141 * GIB,
        host_memory_bytes=2048 * GIB,
        table_counts=YAMBDA_5B_TABLE_COUNTS,
    )
    assert plan.fits and describe(plan).count("\n") > 10 and refusal(plan) == ""
    assert plan.largest_consumer().name.startswith("tables in HBM")


def test_the_host_memory_is_the_cgroup_limit_when_lower(tmp_path):
    from dlrmv4.plan.machine import _meminfo, host_memory

    total = _meminfo("MemTotal")
    limit, unlimited, v1 = tmp_path / "memory.max", tmp_path / "v2-max", tmp_path / "limit_in_bytes"
    limit.write_text(f"{total // 2}\n")
    unlimited.write_text("max\n")
    v1.write_text(f"{(1 << 63) - 4096}\n")  # v1's "no limit"
    assert host_memory((str(limit),)) == total // 2
    assert host_memory((str(unlimited), str(limit))) == total  # the first file found is the cgroup's
    assert host_memory((str(tmp_path / "missing"), str(v1))) == total
    assert host_memory((str(tmp_path / "missing"),)) == total


def test_a_whole_checkpoint_larger_than_the_disk_is_refused_in_one_line(tmp_path, capsys):
    """Yambda-5B's tables on four 139-GiB GPUs with blocking checkpoints fit the devices and the host: the
    disk of the lent four-GPU host (235 GiB) cannot hold its whole checkpoint, and the refusal names the bytes
    and the ways out; without checkpoints the same run fits, and the plan prints the disk beside the memory."""
    args = [
        "plan",
        "--preset",
        "yambda-5b",
        "--plan-world-size",
        "4",
        "--plan-device-memory-gib",
        "139",
        "--plan-host-memory-gib",
        "500",
        "--async-checkpoints",
        "false",
        "--data-path",
        str(tmp_path / "data"),
    ]
    code, out, err = _main(capsys, *args, "--plan-disk-gib", "235")
    whole = _all_hbm_table_bytes(_cfg(tmp_path)) * 8  # every row of every table, the job's
    assert code == 1 and err.count("\n") == 1
    assert err.startswith(
        "[dlrmv4] error: the run's checkpoints do not fit its disk: a whole checkpoint of this run is 560."
    )
    assert (
        "GiB, but the run directory runs/default has 235.00 GiB free; to fit: a run directory on a file system" in err
    )
    assert "a run that writes no checkpoint: --checkpoint-every-window false --final-checkpoint false" in err
    assert "  disk (run directory runs/default, a file system every node sees): a whole checkpoint 560." in out
    assert "235.00 GiB free: room for 0 whole checkpoint(s), the run keeps up to 3 at once" in out
    plan = plan_for_config(
        _cfg(
            tmp_path,
            plan__plan_world_size=4,
            plan__plan_device_memory_gib=139.0,
            plan__plan_host_memory_gib=500.0,
            plan__plan_disk_gib=235.0,
            train__async_checkpoints=False,
        )
    )
    assert not plan.fits and plan.short_of == "disk" and plan.disk.whole >= whole
    assert plan.disk.whole - whole < 2 * GIB  # the rest: the dense weights and Adam's moments

    code, out, err = _main(
        capsys, *args, "--plan-disk-gib", "235", "--checkpoint-every-window", "false", "--final-checkpoint", "false"
    )
    assert code == 0, err
    assert "this run writes no checkpoint" in out and "verdict: fits" in out
    code, out, err = _main(capsys, *args, "--plan-disk-gib", "1200")  # room for two, not the three it keeps
    assert code == 0 and "room for 2 whole checkpoint(s), the run keeps up to 3 at once" in out


def test_the_plan_reads_the_run_directory_s_free_space(tmp_path, monkeypatch):
    """Without --plan-disk-gib the plan asks the file system of the run directory (its nearest existing
    parent until the run makes it), and a checkpoint cadence that writes nothing needs no room."""
    import shutil
    from types import SimpleNamespace

    asked = []

    def usage(path):
        asked.append(Path(path))
        return SimpleNamespace(total=10**12, used=0, free=GIB)

    monkeypatch.setattr(shutil, "disk_usage", usage)
    run_dir = tmp_path / "not" / "yet"
    cfg = _cfg(
        tmp_path,
        "synthetic-tiny",
        plan__plan_world_size=1,
        plan__plan_device_memory_gib=16.0,
        plan__plan_host_memory_gib=64.0,
        train__run_dir=str(run_dir),
        embeddings__item_rows=20_000,
        embeddings__artist_rows=1_000,
        embeddings__album_rows=4_000,
    )
    plan = plan_for_config(cfg)
    assert asked == [tmp_path] and plan.disk.free == GIB and plan.fits
    small = dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan, plan_disk_gib=plan.disk.whole / GIB / 2))
    refused = plan_for_config(small)
    assert not refused.fits and refused.short_of == "disk"
    assert refusal(refused).startswith("the run's checkpoints do not fit its disk: a whole checkpoint of this run is ")
