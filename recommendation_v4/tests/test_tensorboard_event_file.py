"""A run's TensorBoard event file deleted while the run writes it (the file, or its whole folder): the
run says so in one line and writes on to a new file, so the curves continue; where no new file can
be made, it says that and writes no more scalars. Real files, read back with TensorBoard's reader."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from dlrmv4.config_loading import load_config
from dlrmv4.distributed.cluster import Cluster
from dlrmv4.train.history import EvalRecord
from dlrmv4.train.optim import WarmupSchedule
from dlrmv4.train.tensorboard_scalars import EVENT_FILES, TENSORBOARD_DIR, TensorBoardScalars

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def started(run_dir: Path, lines: list[str]) -> TensorBoardScalars:
    schedule = WarmupSchedule(load_config("synthetic-tiny").train)
    scalars = TensorBoardScalars(run_dir, Cluster.single(torch.device("cpu")), schedule, True, lines.append)
    scalars.open(0, resumed=False)
    return scalars


def steps(scalars: TensorBoardScalars, losses: list[float]) -> None:
    for loss in losses:
        scalars.add_step(torch.tensor(loss))
    scalars.write_steps()


def curves(run_dir: Path) -> dict[str, list[int]]:
    reader = event_accumulator.EventAccumulator(str(run_dir / TENSORBOARD_DIR), size_guidance={"scalars": 0})
    reader.Reload()
    return {tag: [e.step for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]}


def event_files(run_dir: Path) -> list[Path]:
    return sorted((run_dir / TENSORBOARD_DIR).glob(EVENT_FILES))


@pytest.mark.parametrize("deleted", ["file", "folder"])
def test_a_deleted_event_file_is_said_once_and_the_curves_go_on_in_a_new_one(tmp_path, deleted):
    lines: list[str] = []
    scalars = started(tmp_path, lines)
    steps(scalars, [0.7, 0.6])
    [first] = event_files(tmp_path)
    if deleted == "file":
        first.unlink()
    else:
        shutil.rmtree(tmp_path / TENSORBOARD_DIR)
    steps(scalars, [0.5])
    scalars.write_eval(EvalRecord(samples_count=384, step=3, window=0, eval_window=9, auc=0.6, seconds=1.0))
    steps(scalars, [0.4])
    scalars.close()
    [second] = event_files(tmp_path)
    assert second != first
    assert lines == [
        f"the TensorBoard event file {first} was deleted during the run: the scalars go on in {second.name} "
        "(the points written before are gone)"
    ]
    got = curves(tmp_path)
    assert got["train/loss"] == [3, 4] and got["eval/auc"] == [3]


def test_where_no_new_event_file_can_be_made_the_run_says_so_and_writes_no_more(tmp_path):
    lines: list[str] = []
    scalars = started(tmp_path, lines)
    steps(scalars, [0.7])
    [first] = event_files(tmp_path)
    shutil.rmtree(tmp_path / TENSORBOARD_DIR)
    (tmp_path / TENSORBOARD_DIR).write_text("a file where the folder was")
    steps(scalars, [0.6])
    scalars.write_eval(EvalRecord(samples_count=256, step=2, window=0, eval_window=9, auc=0.6, seconds=1.0))
    steps(scalars, [0.5])
    scalars.close()
    [line] = lines
    assert line.startswith(
        f"the TensorBoard event file {first} was deleted during the run and a new one cannot be made ("
    )
    assert line.endswith("): this run writes no more TensorBoard scalars")
