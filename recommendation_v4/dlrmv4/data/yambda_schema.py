"""The raw Yambda schema (docs/data.md): file layout, columns, dtypes, event codes, and its checks.

Raw files live as the hub lays them out, under one root:
``flat/<size>/multi_event.parquet``, ``artist_item_mapping.parquet``, ``album_item_mapping.parquet``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dlrmv4.errors import UserError, one_line

# Event type codes (as the reference): listen 0, like 1, dislike 2, unlike 3, undislike 4.
EVENT_TYPES: tuple[str, ...] = ("listen", "like", "dislike", "unlike", "undislike")
EVENT_CODE = {name: code for code, name in enumerate(EVENT_TYPES)}
LISTEN, LIKE, DISLIKE, UNLIKE, UNDISLIKE = range(5)

# History pool bits stored per event (0 = never enters a history).
ACTION_LISTEN_PLUS = 1
ACTION_LIKE = 2
ACTION_SKIP = 4
ACTION_BITS = (ACTION_LISTEN_PLUS, ACTION_LIKE, ACTION_SKIP)

TIMESTAMP_BIN_SECONDS = 5

MULTI_EVENT_COLUMNS = (
    "uid",
    "item_id",
    "timestamp",
    "is_organic",
    "event_type",
    "played_ratio_pct",
    "track_length_seconds",
)
# Exact dtypes the generator writes and the real data has.
MULTI_EVENT_SCHEMA = pa.schema(
    [
        pa.field("uid", pa.uint32(), nullable=False),
        pa.field("item_id", pa.uint32(), nullable=False),
        pa.field("timestamp", pa.uint32(), nullable=False),
        pa.field("is_organic", pa.uint8(), nullable=False),
        pa.field("event_type", pa.dictionary(pa.int8(), pa.string()), nullable=False),
        pa.field("played_ratio_pct", pa.uint16(), nullable=True),
        pa.field("track_length_seconds", pa.uint32(), nullable=True),
    ]
)
INTEGER_COLUMNS = ("uid", "item_id", "timestamp", "is_organic", "played_ratio_pct", "track_length_seconds")


@dataclass(frozen=True)
class RawFiles:
    multi_event: Path
    artist_mapping: Path
    album_mapping: Path

    @staticmethod
    def under(root: Path, size: str) -> "RawFiles":
        return RawFiles(
            multi_event=root / "flat" / size / "multi_event.parquet",
            artist_mapping=root / "artist_item_mapping.parquet",
            album_mapping=root / "album_item_mapping.parquet",
        )

    @staticmethod
    def hub_names(size: str) -> tuple[str, str, str]:
        """Paths of the three files inside the hub repository (same order as ``all``)."""
        return (f"flat/{size}/multi_event.parquet", "artist_item_mapping.parquet", "album_item_mapping.parquet")

    def all(self) -> tuple[Path, Path, Path]:
        return (self.multi_event, self.artist_mapping, self.album_mapping)


def open_parquet(path: Path) -> pq.ParquetFile:
    """Open a parquet file or fail with one line naming it."""
    if not path.exists():
        raise UserError(f"{path}: file is missing (run download_dataset.sh first)")
    try:
        # pre_buffer=False: with pre-buffering, iter_batches keeps every column chunk it has read
        # cached until the reader is dropped, so memory would grow with the file.
        return pq.ParquetFile(path, pre_buffer=False)
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
        raise UserError(f"{path}: not a readable parquet file (truncated or corrupt?): {one_line(exc)}")


def _is_string_like(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def check_multi_event_schema(path: Path, schema: pa.Schema) -> None:
    """Columns present and typed as Yambda types them; event_type may be utf8, categorical or enum."""
    names = set(schema.names)
    for col in MULTI_EVENT_COLUMNS:
        if col not in names:
            raise UserError(f"{path}: column {col!r} is missing (found: {', '.join(schema.names)})")
    for col in INTEGER_COLUMNS:
        t = schema.field(col).type
        if not pa.types.is_integer(t):
            raise UserError(
                f"{path}: column {col!r} has dtype {t}, expected an integer type ({MULTI_EVENT_SCHEMA.field(col).type})"
            )
    t = schema.field("event_type").type
    if not _is_string_like(t):
        raise UserError(f"{path}: column 'event_type' has dtype {t}, expected utf8, categorical or enum")


def check_mapping_schema(path: Path, schema: pa.Schema, id_column: str) -> None:
    for col in (id_column, "item_id"):
        if col not in schema.names:
            raise UserError(f"{path}: column {col!r} is missing (found: {', '.join(schema.names)})")
        t = schema.field(col).type
        if not pa.types.is_integer(t):
            raise UserError(f"{path}: column {col!r} has dtype {t}, expected an integer type")
