"""Delta checkpoints (checkpoint/table_deltas.py, the chains of checkpoint/chain.py): the rows found
changed are exactly the rows that changed, a chain applied over its whole checkpoint gives the tables
back bit for bit, a delta is usable only with its whole chain, and pruning keeps the chains it needs.
The whole-run resume from deltas (kills included, other world sizes) is in tests/test_train.py and
tests/test_distributed.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from dlrmv4.checkpoint import layout, table_deltas
from dlrmv4.checkpoint import writer as checkpoint_writer
from dlrmv4.checkpoint.chain import checkpoint_chain
from dlrmv4.checkpoint.layout import CHAIN_FILE, MARKER
from dlrmv4.checkpoint.loading import load_checkpoint
from dlrmv4.checkpoint.newest import resume_point
from dlrmv4.checkpoint.state import CheckpointPosition
from dlrmv4.checkpoint.table_deltas import ENTRY, ChangedRows, TableRowsDelta, apply_delta
from dlrmv4.checkpoint.tables import TableState
from dlrmv4.checkpoint.writer import CheckpointWriter, save_checkpoint
from dlrmv4.distributed.cluster import Cluster
from dlrmv4.errors import UserError

DIM = 8


class Tables:
    """The part of a backend's tables that checkpoints read: plain tensors whole on one rank."""

    def __init__(self, rows: dict[str, int], seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.cluster = Cluster.single(torch.device("cpu"))
        self.dim = DIM
        self.tables = {
            name: {"weight": torch.randn(n, DIM, generator=generator), "momentum": torch.rand(n, generator=generator)}
            for name, n in rows.items()
        }

    def live_tables(self) -> dict:
        return self.tables


def _position(step: int) -> CheckpointPosition:
    return CheckpointPosition(step=step, samples_seen=step * 4, window=0)


def _update(tables: Tables, name: str, rows: list[int], generator: torch.Generator) -> None:
    """Row-wise Adagrad's shape of update on ``rows``: the momentum grows, the weight moves."""
    grad = torch.randn(len(rows), DIM, generator=generator)
    table = tables.tables[name]
    table["momentum"][rows] += grad.pow(2).mean(1)
    table["weight"][rows] -= 0.01 * grad / (table["momentum"][rows, None].sqrt() + 1e-8)


# Chunks of 3 rows (int64 words of DIM + 1 per row for the fingerprints, then 2 changed rows of DIM
# floats at a time for the copy): chunk boundaries fall inside every table and between changed rows.
@pytest.mark.parametrize("chunks", [False, True])
def test_the_rows_found_changed_are_the_rows_that_changed(monkeypatch, chunks):
    if chunks:
        monkeypatch.setattr(table_deltas, "_FINGERPRINT_CHUNK_BYTES", 3 * 8 * (DIM + 1))
        monkeypatch.setattr(table_deltas, "_GATHER_CHUNK_BYTES", 2 * 4 * DIM)
    tables = Tables({"item": 1000, "uid": 50})
    tracker = ChangedRows()
    tracker.reset(tables)
    generator = torch.Generator().manual_seed(1)
    _update(tables, "item", [3, 17, 999], generator)
    # A small step on a row with a large momentum: the squared gradient is absorbed in the float32 sum,
    # the momentum keeps its bits and only the weight moves. It must still be found.
    item = tables.tables["item"]
    item["momentum"][500] = 1e6
    tracker.reset(tables)
    before = item["momentum"][500].clone()
    item["momentum"][500] += 1e-6
    item["weight"][500, 3] += 1e-3
    assert torch.equal(item["momentum"][500], before)
    _update(tables, "item", [3, 40], generator)
    item["weight"][41, 0] = -item["weight"][41, 0]  # one sign bit
    changed = tracker.take(tables)
    assert set(changed) == {"item"}  # a table with no changed row is left out
    assert changed["item"]["ids"].tolist() == [3, 40, 41, 500]
    assert torch.equal(changed["item"]["weight"], item["weight"][[3, 40, 41, 500]])
    assert torch.equal(changed["item"]["momentum"], item["momentum"][[3, 40, 41, 500]])
    assert tracker.take(tables) == {}  # the snapshot moved to now


def test_a_chain_applied_over_its_whole_checkpoint_gives_the_tables_back(tmp_path):
    tables = Tables({"item": 300, "artist": 40})
    tracker = ChangedRows()
    save_checkpoint(tmp_path, _position(1), {"sparse": TableState(tables)}, keep_last=5)
    tracker.reset(tables)
    generator = torch.Generator().manual_seed(2)
    parent = tmp_path / "checkpoints" / "step-00000001"
    for step, touched in ((2, [1, 2, 3]), (3, [2, 200]), (4, [])):
        if touched:
            _update(tables, "item", touched, generator)
        _update(tables, "artist", [step], generator)
        delta = TableRowsDelta(tracker.take(tables), rank=0)
        parent = save_checkpoint(tmp_path, _position(step), {ENTRY: delta}, keep_last=5, parent=parent)
    newest = resume_point(tmp_path)
    assert [p.name for p in checkpoint_chain(newest)] == [f"step-0000000{s}" for s in (1, 2, 3, 4)]
    assert json.loads((newest / CHAIN_FILE).read_text())["parent"] == "step-00000003"

    restored = Tables({"item": 300, "artist": 40}, seed=9)  # other numbers: everything must come from the files
    whole, *deltas = checkpoint_chain(newest)
    load_checkpoint(whole, {"sparse": TableState(restored)})
    assert [apply_delta(d, restored, restored.cluster) for d in deltas] == [4, 3, 1]
    for name, parts in tables.tables.items():
        for part, tensor in parts.items():
            assert torch.equal(restored.tables[name][part], tensor), (name, part)


class _SplitByColumns:
    """A weight whose rows two ranks hold half each, by columns (TorchRec's column_wise plan)."""

    def __init__(self, rows: int) -> None:
        halves = [SimpleNamespace(shard_offsets=[0, c0], shard_sizes=[rows, DIM // 2]) for c0 in (0, DIM // 2)]
        self._metadata = SimpleNamespace(shards_metadata=halves)

    def metadata(self) -> SimpleNamespace:
        return self._metadata


def test_a_delta_is_not_applied_to_tables_split_by_columns(tmp_path):
    """A chain written with whole rows on each rank, resumed by a run that splits a table by columns:
    refused in one line naming the table and what to do (the rows cannot be written half by half)."""
    tables, tracker = Tables({"item": 30, "artist": 20}), ChangedRows()
    whole = save_checkpoint(tmp_path, _position(1), {"sparse": TableState(tables)}, keep_last=5)
    tracker.reset(tables)
    _update(tables, "item", [4], torch.Generator().manual_seed(3))
    delta = TableRowsDelta(tracker.take(tables), rank=0)
    newest = save_checkpoint(tmp_path, _position(2), {ENTRY: delta}, keep_last=5, parent=whole)
    resumed = Tables({"item": 30, "artist": 20})
    resumed.tables["item"]["weight"] = _SplitByColumns(30)
    with pytest.raises(UserError) as refused:
        apply_delta(newest, resumed, resumed.cluster)
    assert str(refused.value).startswith(f"cannot resume from {newest}, a delta checkpoint: this run splits item ")
    assert "resume with those tables row_wise or table_wise" in str(refused.value)


class _ReusedStagingCopy(BlockingAsyncStager):
    """The asynchronous writer's staging on a GPU (one host copy made at the first save and copied into
    at every later one), without the pinning that needs CUDA."""

    def __init__(self, cache_staged_state_dict: bool = False) -> None:
        super().__init__(cache_staged_state_dict=True)

    def stage(self, state_dict):
        if self.state_dict_cache is None:
            self.state_dict_cache = _create_cpu_state_dict(state_dict)
        return _copy_state_dict(state_dict, self.state_dict_cache)


def test_deltas_of_different_sizes_go_through_the_asynchronous_writer(tmp_path, monkeypatch):
    """A delta's rows are written as they are: the dense state beside them goes through the staging copy
    reused from save to save, and the next delta (other rows, other sizes) must not."""
    monkeypatch.setattr(checkpoint_writer, "BlockingAsyncStager", _ReusedStagingCopy)
    tables, tracker, net = Tables({"item": 300, "artist": 40}), ChangedRows(), torch.nn.Linear(4, 3)
    writer = CheckpointWriter(tmp_path, 5, tables.cluster, asynchronous=True)
    writer.save(_position(1), {"model": net, "sparse": TableState(tables)})
    parent = writer.wait()
    tracker.reset(tables)
    generator = torch.Generator().manual_seed(4)
    for step, touched in ((2, [1, 2, 3]), (3, [5, 6, 7, 8, 9, 200]), (4, [9])):
        _update(tables, "item", touched, generator)
        with torch.no_grad():
            net.weight.add_(1.0)
        writer.save(_position(step), {"model": net, ENTRY: TableRowsDelta(tracker.take(tables), rank=0)}, parent=parent)
        parent = writer.wait()
    writer.close()
    restored, fresh = Tables({"item": 300, "artist": 40}, seed=9), torch.nn.Linear(4, 3)
    whole, *deltas = checkpoint_chain(resume_point(tmp_path))
    load_checkpoint(whole, {"sparse": TableState(restored)})
    assert [apply_delta(d, restored, restored.cluster) for d in deltas] == [3, 6, 1]
    load_checkpoint(deltas[-1], {"model": fresh})
    assert torch.equal(fresh.weight, net.weight)
    for name, parts in tables.tables.items():
        for part, tensor in parts.items():
            assert torch.equal(restored.tables[name][part], tensor), (name, part)


def _chain(tmp_path: Path, keep_last: int = 5) -> Tables:
    """A whole checkpoint at step 1 and deltas at steps 2 and 3."""
    tables = Tables({"item": 100})
    tracker = ChangedRows()
    parent = save_checkpoint(tmp_path, _position(1), {"sparse": TableState(tables)}, keep_last=keep_last)
    tracker.reset(tables)
    generator = torch.Generator().manual_seed(3)
    for step in (2, 3):
        _update(tables, "item", [step], generator)
        entry = {ENTRY: TableRowsDelta(tracker.take(tables), rank=0)}
        parent = save_checkpoint(tmp_path, _position(step), entry, keep_last=keep_last, parent=parent)
    return tables


@pytest.mark.parametrize("damage", ["gone", "damaged", "written again"])
def test_a_delta_is_usable_only_with_its_whole_chain(tmp_path, capsys, damage):
    _chain(tmp_path)
    root = tmp_path / "checkpoints"
    middle = root / "step-00000002"
    if damage == "gone":
        shutil.rmtree(middle)
    elif damage == "damaged":
        (middle / "position.json").write_text("{}")
    else:  # a rerun wrote step 2 again and was killed before it pruned: step 3 is not relative to it
        other = tmp_path / "rerun"
        save_checkpoint(other, _position(2), {"sparse": TableState(Tables({"item": 100}, seed=5))}, keep_last=5)
        shutil.rmtree(middle)
        (other / "checkpoints" / "step-00000002").rename(middle)
    capsys.readouterr()
    expected = "step-00000002" if damage == "written again" else "step-00000001"
    assert resume_point(tmp_path).name == expected
    warnings = capsys.readouterr().err
    assert "skipping checkpoint" in warnings and "step-00000003" in warnings
    reason = {"gone": "is gone", "damaged": "position.json", "written again": "was written again since"}[damage]
    assert reason in warnings, warnings


def test_a_chain_whose_whole_checkpoint_is_damaged_is_refused_in_one_line(tmp_path, capsys):
    _chain(tmp_path)
    (tmp_path / "checkpoints" / "step-00000001" / MARKER).write_text("not json")
    with pytest.raises(UserError) as err:
        resume_point(tmp_path)
    assert "none is usable" in str(err.value) and "\n" not in str(err.value)
    assert "the checkpoint it continues, step-00000001" in str(err.value)


def test_pruning_keeps_every_checkpoint_a_kept_chain_needs(tmp_path):
    tables = _chain(tmp_path, keep_last=1)  # keep one checkpoint: its chain stays whole
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001", "step-00000002", "step-00000003"]
    save_checkpoint(tmp_path, _position(4), {"sparse": TableState(tables)}, keep_last=1)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000004"]


def test_a_second_restore_point_is_kept_on_a_chain_of_its_own(tmp_path, capsys):
    """keep_last=2 with deltas: the newest checkpoint of the chain before stays, whole chain and all,
    so a damaged whole checkpoint of the newest chain still leaves a restore point."""
    tables = _chain(tmp_path, keep_last=2)  # step 1 whole, deltas 2 and 3
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001", "step-00000002", "step-00000003"]
    tracker = ChangedRows()
    parent = save_checkpoint(tmp_path, _position(4), {"sparse": TableState(tables)}, keep_last=2)  # whole
    tracker.reset(tables)
    _update(tables, "item", [4], torch.Generator().manual_seed(4))
    delta = {ENTRY: TableRowsDelta(tracker.take(tables), rank=0)}
    save_checkpoint(tmp_path, _position(5), delta, keep_last=2, parent=parent)
    names = ["step-00000001", "step-00000002", "step-00000003", "step-00000004", "step-00000005"]
    assert sorted(p.name for p in root.iterdir()) == names
    (root / "step-00000004" / MARKER).write_text("not json")  # the newest chain's whole checkpoint
    point = resume_point(tmp_path)
    assert point is not None and point.name == "step-00000003"
    # A third chain: the first is no longer needed.
    save_checkpoint(tmp_path, _position(6), {"sparse": TableState(tables)}, keep_last=2)
    assert "step-00000001" not in {p.name for p in root.iterdir()}


def test_a_rerun_s_save_prunes_the_deltas_its_rewrite_left_stale(tmp_path):
    """A rerun from step 1 writes step 2 again: step 3 (a delta of the old step 2) is no restore
    point, and does not push step 1 out."""
    _chain(tmp_path)
    save_checkpoint(tmp_path, _position(2), {"sparse": TableState(Tables({"item": 100}, seed=5))}, keep_last=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000001", "step-00000002"]


def test_a_chain_s_shared_checkpoints_are_hashed_once(tmp_path, monkeypatch):
    """Looking for a resume point over a chain whose whole checkpoint is damaged reads each file once,
    not once for every delta that continues it."""
    _chain(tmp_path)
    whole = tmp_path / "checkpoints" / "step-00000001"
    tensors = max(whole.rglob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(tensors.read_bytes())
    data[len(data) // 2] ^= 1
    tensors.write_bytes(bytes(data))
    hashed: list[Path] = []
    real = layout.sha256
    monkeypatch.setattr(layout, "sha256", lambda path: hashed.append(path) or real(path))
    with pytest.raises(UserError, match="none is usable"):
        resume_point(tmp_path)
    content = [p for p in hashed if p.name != MARKER]
    assert content and len(content) == len(set(content))


class _TwoWriters(TableRowsDelta):
    """The delta two row-wise ranks would write: rank 0 rows [0, 50) of "item", rank 1 rows [50, 100)."""

    def state_dict(self) -> dict:
        low, high = (self.rows["item"]["ids"] < 50), (self.rows["item"]["ids"] >= 50)
        halves = {f"rank{r}": {p: t[m] for p, t in self.rows["item"].items()} for r, m in enumerate((low, high))}
        return {"rows": {"item": halves}}


class _Block:
    """A ShardedTensor's face as table_deltas reads it: one local row block of a table from ``row0``."""

    def __init__(self, tensor: torch.Tensor, row0: int) -> None:
        self.tensor = tensor
        self.metadata = SimpleNamespace(shard_offsets=[row0, 0], shard_sizes=[len(tensor), DIM])

    def local_shards(self) -> list:
        return [self]


def test_a_rank_reads_the_rows_of_the_writers_whose_blocks_it_holds(tmp_path, monkeypatch):
    """After a change of world size a rank's rows come from some writers: it reads every writer's ids,
    then only those writers' rows."""
    tables = Tables({"item": 100})
    tracker = ChangedRows()
    parent = save_checkpoint(tmp_path, _position(1), {"sparse": TableState(tables)}, keep_last=5)
    tracker.reset(tables)
    _update(tables, "item", [10, 20, 60], torch.Generator().manual_seed(7))
    changed = tracker.take(tables)
    delta = save_checkpoint(tmp_path, _position(2), {ENTRY: _TwoWriters(changed, 0)}, keep_last=5, parent=parent)
    # This rank holds rows [60, 100) only: rows 60.. of a restored copy, stale until the delta.
    item = Tables({"item": 100}).tables["item"]
    block = {"weight": _Block(item["weight"][60:].clone(), 60), "momentum": _Block(item["momentum"][60:].clone(), 60)}
    holder = SimpleNamespace(live_tables=lambda: {"item": block}, dim=DIM, cluster=tables.cluster)
    monkeypatch.setattr(table_deltas, "split_by_columns", lambda embeddings: [])
    loaded: list[list[str]] = []
    real = table_deltas.dcp_load
    monkeypatch.setattr(
        table_deltas,
        "dcp_load",
        lambda state, path, cluster: (
            loaded.append(sorted(f"{w}.{p}" for w, parts in state[ENTRY]["rows"]["item"].items() for p in parts))
            or real(state, path, cluster)
        ),
    )
    assert apply_delta(delta, holder, tables.cluster) == 3
    assert loaded == [["rank0.ids", "rank1.ids"], ["rank1.momentum", "rank1.weight"]]
    assert torch.equal(block["weight"].tensor[0], tables.tables["item"]["weight"][60])
    assert torch.equal(block["momentum"].tensor[0], tables.tables["item"]["momentum"][60])
