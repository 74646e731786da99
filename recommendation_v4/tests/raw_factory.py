"""Small raw Yambda-schema datasets with controlled content, written as real parquet files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from dlrmv4.data.yambda_schema import EVENT_TYPES, MULTI_EVENT_SCHEMA, RawFiles

SIZE = "tiny"


@dataclass
class RawEvents:
    uid: np.ndarray
    item_id: np.ndarray
    timestamp: np.ndarray
    is_organic: np.ndarray
    event_type: np.ndarray  # codes 0..4
    played_ratio_pct: np.ndarray  # ignored (null) where event_type != listen; an object array may hold None


def random_events(
    seed: int, num_users: int = 30, max_events: int = 400, span_days: int = 12, num_items: int = 300
) -> RawEvents:
    """Users with bursts of events over ``span_days``, sorted by (uid, timestamp)."""
    rng = np.random.default_rng(seed)
    uids = np.sort(rng.choice(10 * num_users, num_users, replace=False)).astype(np.uint32)
    counts = rng.integers(1, max_events, num_users)
    parts = []
    for count in counts:
        start = rng.integers(0, span_days * 86_400 // 2)
        gaps = np.where(rng.random(count) < 0.05, rng.integers(1_800, 40_000, count), rng.integers(0, 120, count))
        parts.append(((start + np.cumsum(gaps)) // 5 * 5).astype(np.uint32))
    ts = np.concatenate(parts)
    n = len(ts)
    return RawEvents(
        uid=np.repeat(uids, counts),
        item_id=rng.integers(0, num_items, n).astype(np.uint32),
        timestamp=ts,
        is_organic=rng.integers(0, 2, n).astype(np.uint8),
        event_type=rng.choice(5, n, p=[0.9, 0.05, 0.02, 0.02, 0.01]).astype(np.int8),
        played_ratio_pct=rng.integers(0, 200, n).astype(np.uint16),
    )


def events_table(ev: RawEvents, event_type_kind: str = "dictionary") -> pa.Table:
    listen = ev.event_type == 0
    names = np.array(EVENT_TYPES, dtype=object)[ev.event_type]
    if event_type_kind == "dictionary":
        etype = pa.DictionaryArray.from_arrays(pa.array(ev.event_type, pa.int8()), pa.array(EVENT_TYPES))
    elif event_type_kind == "string":
        etype = pa.array(names, pa.string())
    elif event_type_kind == "large_string":
        etype = pa.array(names, pa.large_string())
    else:
        raise ValueError(event_type_kind)
    return pa.table(
        {
            "uid": pa.array(ev.uid, pa.uint32()),
            "item_id": pa.array(ev.item_id, pa.uint32()),
            "timestamp": pa.array(ev.timestamp, pa.uint32()),
            "is_organic": pa.array(ev.is_organic, pa.uint8()),
            "event_type": etype,
            "played_ratio_pct": _ratio_array(ev.played_ratio_pct, listen),
            "track_length_seconds": pa.array(np.full(len(ev.uid), 180, np.uint32), pa.uint32(), mask=~listen),
        }
    )


def _ratio_array(ratio: np.ndarray, listen: np.ndarray) -> pa.Array:
    if ratio.dtype == object:  # None marks a listen with a null ratio
        return pa.array([int(r) if ok and r is not None else None for r, ok in zip(ratio, listen)], pa.uint16())
    return pa.array(ratio, pa.uint16(), mask=~listen)


def write_mapping(path: Path, id_column: str, rows: list[tuple[int, int]]) -> None:
    """A mapping file with exactly these (item_id, id) rows, in this order."""
    pq.write_table(
        pa.table(
            {
                id_column: pa.array([r[1] for r in rows], pa.uint32()),
                "item_id": pa.array([r[0] for r in rows], pa.uint32()),
            }
        ),
        path,
    )


def write_raw(
    root: Path,
    ev: RawEvents,
    *,
    event_type_kind: str = "dictionary",
    num_items: int = 300,
    table: pa.Table | None = None,
    row_group_size: int = 5_000,
) -> RawFiles:
    files = RawFiles.under(root, SIZE)
    files.multi_event.parent.mkdir(parents=True, exist_ok=True)
    if event_type_kind == "enum":
        df = pl.from_arrow(events_table(ev, "string"))
        df = df.with_columns(pl.col("event_type").cast(pl.Enum(list(EVENT_TYPES))))
        df.write_parquet(files.multi_event, row_group_size=row_group_size)
    else:
        tbl = table if table is not None else events_table(ev, event_type_kind)
        if table is None and event_type_kind == "dictionary":
            tbl = tbl.cast(MULTI_EVENT_SCHEMA)
        pq.write_table(tbl, files.multi_event, row_group_size=row_group_size)
    items = np.arange(num_items, dtype=np.uint32)
    mapped = items[items % 17 != 5]  # a few items without mapping rows: they join to 0
    pq.write_table(pa.table({"artist_id": mapped // 7 + 1, "item_id": mapped}), files.artist_mapping)
    pq.write_table(
        pa.table(
            {
                "album_id": np.concatenate([mapped // 3 + 2, mapped // 3 + 9]),
                "item_id": np.concatenate([mapped, mapped]),
            }
        ),
        files.album_mapping,
    )
    return files
