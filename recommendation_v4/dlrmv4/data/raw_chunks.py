"""Reading the raw Yambda events for the preprocessing pass (``preprocess.py``): the file cut into
chunks at user boundaries, each chunk's rows read and checked (order, event types), the users and
their sessions found, and the item-to-artist/album tables read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from dlrmv4.config import PreprocessConfig
from dlrmv4.data.yambda_schema import EVENT_CODE, EVENT_TYPES, RawFiles, check_mapping_schema, open_parquet
from dlrmv4.errors import UserError, one_line

RAW_COLUMNS = ["uid", "item_id", "timestamp", "is_organic", "event_type", "played_ratio_pct"]


def decode_event_types(df: pl.DataFrame, path: Path, row_base: int) -> np.ndarray:
    names = df.get_column("event_type").cast(pl.String)
    known = names.is_in(list(EVENT_TYPES))
    if not bool(known.all()):
        bad_row = int(np.flatnonzero(~known.to_numpy())[0])
        raise UserError(
            f"{path}: unknown event_type {names[bad_row]!r} at row {row_base + bad_row} "
            f"(expected one of {', '.join(EVENT_TYPES)})"
        )
    return names.replace_strict(EVENT_CODE, return_dtype=pl.UInt8).to_numpy()


def check_order(uid: np.ndarray, ts: np.ndarray, prev: tuple[int, int] | None, path: Path, row_base: int) -> None:
    """Rows must be sorted by (uid, timestamp); the previous chunk's last row joins the check."""
    if prev is not None and len(uid):
        uid = np.concatenate([np.array([prev[0]], uid.dtype), uid])
        ts = np.concatenate([np.array([prev[1]], ts.dtype), ts])
        row_base -= 1
    if len(uid) < 2:
        return
    u = uid.astype(np.int64)
    t = ts.astype(np.int64)
    du, dt = np.diff(u), np.diff(t)
    bad = (du < 0) | ((du == 0) & (dt < 0))
    if bad.any():
        row = int(np.flatnonzero(bad)[0]) + 1
        raise UserError(
            f"{path}: rows are not sorted by (uid, timestamp) at row {row_base + row} "
            f"(uid {u[row - 1]}->{u[row]}, timestamp {t[row - 1]}->{t[row]})"
        )


def user_starts(uid: np.ndarray) -> np.ndarray:
    """Index of the first row of each user run in a uid-sorted array, plus len at the end."""
    if len(uid) == 0:
        return np.zeros(1, np.int64)
    change = np.flatnonzero(uid[1:] != uid[:-1]) + 1
    return np.concatenate([[0], change, [len(uid)]]).astype(np.int64)


def local_index(starts: np.ndarray, n: int) -> np.ndarray:
    """Position of each row inside its user run."""
    lengths = np.diff(starts)
    return np.arange(n, dtype=np.int64) - np.repeat(starts[:-1], lengths)


def session_numbers(starts: np.ndarray, ts: np.ndarray, gap_seconds: int) -> np.ndarray:
    """Per-user session number from 0: a new session when the gap to the previous event is > the gap."""
    if len(ts) == 0:
        return np.zeros(0, np.uint32)
    new = np.diff(ts.astype(np.int64), prepend=np.int64(ts[0])) > gap_seconds
    new[starts[:-1]] = True
    cum = np.cumsum(new, dtype=np.int64)
    return (cum - np.repeat(cum[starts[:-1]], np.diff(starts))).astype(np.uint32)


def resolve_t_end(path: Path, pf: pq.ParquetFile, cfg: PreprocessConfig) -> int:
    """The exclusive split end: ``last_timestamp``, or when 0 the data's largest timestamp."""
    if cfg.last_timestamp:
        return cfg.last_timestamp
    return column_max(path, pf, "timestamp")


def column_max(path: Path, pf: pq.ParquetFile, name: str) -> int:
    """A column's largest value: from the row groups' statistics (no pass over the data) where
    every group has them, else by a scan."""
    col = pf.schema_arrow.get_field_index(name)
    best = -1
    for rg in range(pf.metadata.num_row_groups):
        stats = pf.metadata.row_group(rg).column(col).statistics
        if stats is None or not stats.has_min_max:
            return int(pl.scan_parquet(path).select(pl.col(name).max()).collect().item())
        best = max(best, int(stats.max))
    return best


def check_items_mapped(raw: RawFiles, largest_event_item: int, mapped: dict[Path, int]) -> None:
    """Every event's item must have a row in the artist and album mappings: the reference refuses
    data whose item ids run past a mapping's largest (its popularity table must have one row per
    mapped item), where giving such items artist and album 0 would train on made-up ids."""
    for path, largest in mapped.items():
        if largest_event_item > largest:
            raise UserError(
                f"{raw.multi_event}: item ids run to {largest_event_item:,}, past the largest item id of "
                f"{path} ({largest:,}): every event's item needs a row in the artist and album mappings"
            )


def read_item_table(path: Path, id_column: str) -> tuple[np.ndarray, np.ndarray]:
    """(item, id) pairs, one per item: the item's last row in file order (as the reference assigns)."""
    pf = open_parquet(path)
    check_mapping_schema(path, pf.schema_arrow, id_column)
    try:
        df = pl.read_parquet(path, columns=["item_id", id_column])
    except Exception as exc:  # polars raises several types for damaged files
        raise UserError(f"{path}: cannot read ({one_line(exc)})")
    items = df.get_column("item_id").to_numpy().astype(np.int64)
    ids = df.get_column(id_column).to_numpy().astype(np.int64)
    if len(items) and (items.min() < 0 or ids.min() < 0):
        raise UserError(f"{path}: negative ids")
    # np.unique keeps the first occurrence: over the reversed rows that is each item's last row.
    last_items, first_rev = np.unique(items[::-1], return_index=True)
    return last_items, ids[::-1][first_rev]


def item_table(items: np.ndarray, ids: np.ndarray, num_items: int) -> np.ndarray:
    table = np.zeros(num_items, np.uint32)
    keep = items < num_items
    table[items[keep]] = ids[keep]
    return table


@dataclass(frozen=True)
class Chunk:
    """Row groups [first, stop) of the raw file, starting at file row ``row_base``. It owns the users
    whose first row lies in them, whole: their rows that run on into the next groups too."""

    first: int
    stop: int
    row_base: int


def plan_chunks(pf: pq.ParquetFile, rows_per_chunk: int) -> list[Chunk]:
    """Consecutive row groups of about ``rows_per_chunk`` rows each (at least one group)."""
    chunks, first, rows, base = [], 0, 0, 0
    for g in range(pf.metadata.num_row_groups):
        rows += pf.metadata.row_group(g).num_rows
        if rows >= rows_per_chunk or g == pf.metadata.num_row_groups - 1:
            chunks.append(Chunk(first, g + 1, base))
            first, base, rows = g + 1, base + rows, 0
    return chunks


def read_groups(pf: pq.ParquetFile, path: Path, groups: range, columns: list[str]) -> pa.Table:
    try:
        return pf.read_row_groups(list(groups), columns=columns)
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
        raise UserError(f"{path}: read failed (truncated or corrupt parquet?): {one_line(exc)}")


def owned_rows(pf: pq.ParquetFile, path: Path, chunk: Chunk) -> tuple[pl.DataFrame, int]:
    """The rows of the users ``chunk`` owns, and the file row of the first. Checks the (uid,
    timestamp) order of its groups' rows, the previous group's last row included."""
    table = read_groups(pf, path, range(chunk.first, chunk.stop), RAW_COLUMNS)
    uid = table.column("uid").to_numpy()
    prev = None
    if chunk.first:
        before = read_groups(pf, path, range(chunk.first - 1, chunk.first), ["uid", "timestamp"])
        prev = (int(before.column("uid")[-1].as_py()), int(before.column("timestamp")[-1].as_py()))
    check_order(uid, table.column("timestamp").to_numpy(), prev, path, chunk.row_base)
    skip = 0  # rows that continue the user an earlier chunk owns
    if prev is not None and len(uid) and uid[0] == prev[0]:
        differs = uid != prev[0]
        skip = int(np.argmax(differs)) if bool(differs.any()) else len(uid)
    parts = [table.slice(skip)]
    if skip < len(uid):  # the last user's rows that run on into the next groups
        last = uid[-1]
        for g in range(chunk.stop, pf.metadata.num_row_groups):
            nxt = read_groups(pf, path, range(g, g + 1), RAW_COLUMNS)
            same = nxt.column("uid").to_numpy() == last
            run = len(same) if bool(same.all()) else int(np.argmin(same))
            parts.append(nxt.slice(0, run))
            if run < len(same):
                break
    df = pl.from_arrow(pa.concat_tables(parts))
    assert isinstance(df, pl.DataFrame)
    return df, chunk.row_base + skip
