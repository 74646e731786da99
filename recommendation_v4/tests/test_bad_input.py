"""Bad raw input: one clear error naming the file, and no store (or temp leftovers) written."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from raw_factory import events_table, random_events, write_raw

from dlrmv4.config_loading import load_config
from dlrmv4.data.preprocess import preprocess
from dlrmv4.data.store import read_md5s
from dlrmv4.errors import UserError

CFG = load_config(
    None,
    None,
    {
        ("preprocess", "last_timestamp"): 0,
        ("preprocess", "num_train_days"): 9,
        ("preprocess", "min_history"): 40,
        ("preprocess", "rows_per_chunk"): 1_000,
    },
)


def _fails(tmp_path: Path, raw, match: str, cfg=CFG) -> str:
    out = tmp_path / "data" / "processed" / "store"
    with pytest.raises(UserError, match=match) as info:
        preprocess(raw, out, cfg.dataset, cfg.preprocess, progress=False)
    assert not out.exists(), "a failed run must not leave a store"
    leftovers = [p.name for p in out.parent.iterdir()] if out.parent.exists() else []
    assert leftovers == [], f"temporary files left behind: {leftovers}"
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.fixture
def events():
    return random_events(11, num_users=12)


def _with_column(table: pa.Table, name: str, array: pa.Array, new_name: str | None = None) -> pa.Table:
    i = table.schema.get_field_index(name)
    return table.set_column(i, new_name or name, array)


def test_missing_file(tmp_path, events):
    raw = write_raw(tmp_path / "raw", events)
    raw.multi_event.unlink()
    assert str(raw.multi_event) in _fails(tmp_path, raw, "file is missing")


def test_missing_mapping_file(tmp_path, events):
    raw = write_raw(tmp_path / "raw", events)
    raw.album_mapping.unlink()
    assert str(raw.album_mapping) in _fails(tmp_path, raw, "file is missing")


def test_truncated_parquet(tmp_path, events):
    raw = write_raw(tmp_path / "raw", events)
    data = raw.multi_event.read_bytes()
    raw.multi_event.write_bytes(data[: len(data) // 2])
    assert str(raw.multi_event) in _fails(tmp_path, raw, "truncated or corrupt")


def test_corrupt_row_group(tmp_path, events):
    raw = write_raw(tmp_path / "raw", events, row_group_size=500)
    data = bytearray(raw.multi_event.read_bytes())
    # Keep the footer intact so the file opens, damage the column chunks in the middle.
    middle = len(data) // 3
    data[middle : middle + 4096] = os.urandom(4096)
    raw.multi_event.write_bytes(bytes(data))
    _fails(tmp_path, raw, str(raw.multi_event))


def test_missing_column(tmp_path, events):
    table = events_table(events).drop_columns(["is_organic"])
    raw = write_raw(tmp_path / "raw", events, table=table)
    _fails(tmp_path, raw, "column 'is_organic' is missing")


def test_renamed_column(tmp_path, events):
    table = events_table(events)
    table = _with_column(table, "item_id", table.column("item_id"), "track_id")
    raw = write_raw(tmp_path / "raw", events, table=table)
    _fails(tmp_path, raw, "column 'item_id' is missing")


def test_wrong_dtype(tmp_path, events):
    table = events_table(events)
    table = _with_column(table, "timestamp", pa.array(events.timestamp.astype(np.float64)))
    raw = write_raw(tmp_path / "raw", events, table=table)
    _fails(tmp_path, raw, "column 'timestamp' has dtype double")


def test_wrong_event_type_dtype(tmp_path, events):
    table = _with_column(events_table(events), "event_type", pa.array(events.event_type.astype(np.int32)))
    raw = write_raw(tmp_path / "raw", events, table=table)
    _fails(tmp_path, raw, "'event_type' has dtype int32")


def test_unknown_event_type(tmp_path, events):
    names = np.array(["listen", "like", "dislike", "unlike", "undislike"], dtype=object)[events.event_type]
    names[len(names) // 2] = "skip"
    table = _with_column(events_table(events), "event_type", pa.array(names, pa.string()))
    raw = write_raw(tmp_path / "raw", events, table=table)
    msg = _fails(tmp_path, raw, "unknown event_type 'skip'")
    assert f"row {len(names) // 2}" in msg


def test_null_ratio_listen_with_error_policy(tmp_path, events):
    table = events_table(events)
    ratio = table.column("played_ratio_pct").to_pylist()
    first_listen = int(np.flatnonzero(events.event_type == 0)[3])
    ratio[first_listen] = None
    table = _with_column(table, "played_ratio_pct", pa.array(ratio, pa.uint16()))
    raw = write_raw(tmp_path / "raw", events, table=table)
    cfg = load_config(
        None,
        None,
        {
            **{("preprocess", k): v for k, v in dataclasses.asdict(CFG.preprocess).items()},
            ("preprocess", "null_ratio_policy"): "error",
        },
    )
    msg = _fails(tmp_path, raw, "null played_ratio_pct", cfg)
    assert f"row {first_listen}" in msg


@pytest.mark.parametrize("where", ["first_chunk", "chunk_boundary"])
def test_rows_out_of_order(tmp_path, events, where):
    ts = events.timestamp.copy()
    uid = events.uid.copy()
    if where == "first_chunk":
        # Two rows of one user swapped in time.
        i = int(np.flatnonzero((uid[1:] == uid[:-1]) & (ts[1:] > ts[:-1]))[0])
        ts[i], ts[i + 1] = ts[i + 1], ts[i]
        expect_row = i + 1
    else:
        # A user that reappears after the 1,000-row chunk boundary.
        expect_row = 1_000
        uid[expect_row] = uid[0]
    raw = write_raw(tmp_path / "raw", dataclasses.replace(events, timestamp=ts, uid=uid))
    msg = _fails(tmp_path, raw, "not sorted by \\(uid, timestamp\\)")
    assert f"row {expect_row}" in msg


def test_empty_dataset(tmp_path, events):
    table = events_table(events).slice(0, 0)
    raw = write_raw(tmp_path / "raw", events, table=table)
    _fails(tmp_path, raw, "empty")


def test_no_events_in_train_span(tmp_path, events):
    cfg = load_config(
        None, None, {("preprocess", "last_timestamp"): 4_000_000_000, ("preprocess", "num_train_days"): 2}
    )
    raw = write_raw(tmp_path / "raw", events)
    _fails(tmp_path, raw, "no events fall in the train span", cfg)


def test_unwritable_data_path(tmp_path, events):
    raw = write_raw(tmp_path / "raw", events)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the data path should be")
    out = blocker / "processed" / "store"
    with pytest.raises(UserError, match="not writable"):
        preprocess(raw, out, CFG.dataset, CFG.preprocess, progress=False)


def test_failed_rerun_keeps_the_previous_store(tmp_path, events):
    raw = write_raw(tmp_path / "raw", events)
    out = tmp_path / "data" / "processed" / "store"
    preprocess(raw, out, CFG.dataset, CFG.preprocess, progress=False)
    before = read_md5s(out)
    table = events_table(events)
    table = _with_column(table, "uid", pa.array(events.uid[::-1].copy()))
    pq.write_table(table, raw.multi_event)
    with pytest.raises(UserError):
        preprocess(raw, out, CFG.dataset, CFG.preprocess, progress=False)
    assert read_md5s(out) == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["store"]


def test_items_past_the_mappings_are_refused(tmp_path, events):
    """The reference refuses events whose items run past the artist/album mappings; so do we,
    before anything is written (we used to give such items artist and album 0)."""
    largest = int(events.item_id.max())
    raw = write_raw(tmp_path / "raw", events, num_items=largest)  # mapping rows stop one item short
    message = _fails(tmp_path, raw, "past the largest item id")
    assert f"item ids run to {largest:,}" in message and str(raw.artist_mapping) in message


def test_cli_reports_one_line_and_exit_1(tmp_path, events):
    raw_root = tmp_path / "data" / "raw" / "synthetic-tiny"
    write_raw(raw_root, events)
    (raw_root / "flat" / "tiny" / "multi_event.parquet").write_bytes(b"PAR1 definitely not parquet")
    proc = subprocess.run(
        [sys.executable, "-m", "dlrmv4", "preprocess", "--data-path", str(tmp_path / "data"), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("[dlrmv4] error:") and "multi_event.parquet" in lines[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("workers", [1, 3])
def test_the_first_bad_row_is_named_for_any_number_of_workers(tmp_path, events, workers):
    """Rows out of order in two chunks: the error names the first, whichever process finds it."""
    uid = events.uid.copy()
    for row in (1_000, 2_000):  # users that reappear after a 1,000-row chunk boundary
        uid[row] = uid[0]
    raw = write_raw(tmp_path / "raw", dataclasses.replace(events, uid=uid), row_group_size=500)
    cfg = dataclasses.replace(CFG, preprocess=dataclasses.replace(CFG.preprocess, workers=workers))
    msg = _fails(tmp_path, raw, "not sorted by \\(uid, timestamp\\)", cfg)
    assert "at row 1000 " in msg


def test_a_store_that_cannot_be_written_is_one_line(tmp_path, events):
    """A write that fails while the store is built (here a file-size limit: EFBIG, as a full disk
    gives ENOSPC) names the store and the cause, and leaves neither a store nor temp files."""
    raw = write_raw(tmp_path / "raw", events)
    out = tmp_path / "data" / "processed" / "store"
    child = f"""
import resource, sys
from pathlib import Path
from dlrmv4.config_loading import load_config
from dlrmv4.data.preprocess import preprocess
from dlrmv4.data.yambda_schema import RawFiles
from dlrmv4.errors import UserError
cfg = load_config(None, None, {{("preprocess", "last_timestamp"): 0, ("preprocess", "num_train_days"): 9,
                               ("preprocess", "min_history"): 40}})
resource.setrlimit(resource.RLIMIT_FSIZE, (2_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
try:
    preprocess(RawFiles.under(Path({str(raw.multi_event.parents[2])!r}), {raw.multi_event.parent.name!r}),
               Path({str(out)!r}), cfg.dataset, cfg.preprocess, progress=False)
except UserError as exc:
    print(exc)
"""
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == f"cannot write {out}: File too large", proc.stdout + proc.stderr
    assert not out.exists() and list(out.parent.iterdir()) == []
