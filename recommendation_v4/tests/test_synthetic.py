"""The synthetic Yambda generator: schema, order, time bins, signal, determinism, atomic writes."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dlrmv4.config_loading import load_config
from dlrmv4.data import synthetic
from dlrmv4.data.yambda_schema import DISLIKE, EVENT_TYPES, LIKE, LISTEN, MULTI_EVENT_SCHEMA, UNLIKE, RawFiles
from dlrmv4.errors import UserError

SEED = 7


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> RawFiles:
    return synthetic.generate(tmp_path_factory.mktemp("tiny"), "tiny", SEED, progress=False)


@pytest.fixture(scope="module")
def events(tiny) -> dict[str, np.ndarray]:
    table = pq.read_table(tiny.multi_event)
    out = {name: table.column(name).to_numpy() for name in ("uid", "item_id", "timestamp", "is_organic")}
    out["event_type"] = table.column("event_type").combine_chunks().indices.to_numpy().astype(np.int64)
    for name in ("played_ratio_pct", "track_length_seconds"):
        col = table.column(name).combine_chunks()
        out[name] = col.fill_null(0).to_numpy()
        out[name + "_valid"] = col.is_valid().to_numpy(zero_copy_only=False)
    return out


def _table_hash(path: Path) -> str:
    sink = pa.BufferOutputStream()
    table = pq.read_table(path).combine_chunks()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return hashlib.sha256(sink.getvalue().to_pybytes()).hexdigest()


def _leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if ".tmp" in p.name]  # write_atomically: .<name>.tmp-<pid>-<hex>


def test_schema_is_exactly_yambda(tiny):
    assert pq.read_schema(tiny.multi_event).equals(MULTI_EVENT_SCHEMA)
    for path, id_name in ((tiny.artist_mapping, "artist_id"), (tiny.album_mapping, "album_id")):
        schema = pq.read_schema(path)
        assert schema.names == [id_name, "item_id"]
        assert all(t == pa.uint32() for t in schema.types)
    values = pq.read_table(tiny.multi_event, columns=["event_type"]).column("event_type").chunk(0).dictionary
    assert values.to_pylist() == list(EVENT_TYPES)


def test_sorted_by_user_then_time(events):
    uid, ts = events["uid"].astype(np.int64), events["timestamp"].astype(np.int64)
    assert np.all((np.diff(uid) > 0) | ((np.diff(uid) == 0) & (np.diff(ts) >= 0)))
    assert uid[0] == 0 and len(np.unique(uid)) == synthetic.SPECS["tiny"].users


def test_timestamps_are_5s_bins_from_zero_within_span(events):
    ts = events["timestamp"]
    assert np.all(ts % 5 == 0)
    assert ts.min() == 0
    assert ts.max() < synthetic.SPECS["tiny"].days * 86_400 + 5


def test_sessions_are_bursts_separated_by_long_gaps(events):
    uid, ts = events["uid"].astype(np.int64), events["timestamp"].astype(np.int64)
    after_ramp = ts[:-1] >= synthetic.launch_ramp_seconds(synthetic.SPECS["tiny"].days)
    same_user = np.diff(uid) == 0
    gaps = np.diff(ts)[same_user & after_ramp]  # the launch ramp stretches every gap
    assert not np.any((gaps > 65) & (gaps < 1_800))  # 0-60 s steps (+5 s for a late like) or a new session
    new_session = np.diff(ts)[same_user] >= 1_800
    sessions_per_user = np.unique(uid[1:][same_user][new_session], return_counts=True)[1] + 1
    assert np.median(sessions_per_user) >= 5


def test_listen_columns_are_null_off_listens_and_some_ratios_null(events):
    listen = events["event_type"] == LISTEN
    assert np.array_equal(events["track_length_seconds_valid"], listen)
    assert np.all(events["track_length_seconds"][listen] > 0)
    ratio_valid = events["played_ratio_pct_valid"]
    assert not np.any(ratio_valid & ~listen)
    null_share = np.mean(~ratio_valid[listen])  # listens whose ratio was lost (the reference: a skip)
    assert 0.003 < null_share < 0.008, null_share


def test_timestamp_ties_within_a_user(events):
    uid, ts, et = events["uid"].astype(np.int64), events["timestamp"].astype(np.int64), events["event_type"]
    listen = et == LISTEN
    tied = (np.diff(uid[listen]) == 0) & (np.diff(ts[listen]) == 0)  # two listens in one 5-s bin
    assert 0.01 < tied.mean() < 0.06, tied.mean()
    runs = np.unique(np.stack([uid[listen][1:][tied], ts[listen][1:][tied]]), axis=1, return_counts=True)[1]
    assert runs.max() >= 2  # some bins hold three listens or more


def test_event_mix_and_replays(events):
    et = events["event_type"]
    counts = np.bincount(et, minlength=len(EVENT_TYPES))
    assert np.all(counts > 0), dict(zip(EVENT_TYPES, counts))
    share = counts / len(et)
    assert 0.95 < share[LISTEN] < 0.99
    assert 0.01 < share[LIKE] < 0.035
    assert 0.001 < share[DISLIKE] < 0.006
    ratio = events["played_ratio_pct"][et == LISTEN]
    assert 0.5 < np.mean(ratio >= 50) < 0.7
    assert np.any(ratio > 100) and ratio.max() <= 300


def test_likes_follow_a_listen_plus_and_unlikes_a_like(events):
    uid, item, ts, et = events["uid"], events["item_id"], events["timestamp"], events["event_type"]
    # A like follows a listen_plus, or a listen whose ratio was lost.
    plus = (et == LISTEN) & ((events["played_ratio_pct"] >= 50) | ~events["played_ratio_pct_valid"])
    listened = set(zip(uid[plus].tolist(), item[plus].tolist(), ts[plus].tolist()))
    for u, i, t in zip(uid[et == LIKE].tolist(), item[et == LIKE].tolist(), ts[et == LIKE].tolist()):
        assert (u, i, t) in listened or (u, i, t - 5) in listened
    first_like = {}
    for u, i, t in zip(uid[et == LIKE].tolist(), item[et == LIKE].tolist(), ts[et == LIKE].tolist()):
        first_like.setdefault((u, i), t)
    for u, i, t in zip(uid[et == UNLIKE].tolist(), item[et == UNLIKE].tolist(), ts[et == UNLIKE].tolist()):
        assert first_like[(u, i)] <= t


def test_per_user_activity_is_heavy_tailed(events):
    counts = np.unique(events["uid"], return_counts=True)[1]
    assert counts.max() > 5 * np.median(counts)
    assert 150_000 <= len(events["uid"]) <= 300_000


def _last_row_wins(table: pa.Table, id_name: str, n_items: int) -> np.ndarray:
    """Per item, the id of its last row in file order (the reference's rule); -1 when unmapped."""
    out = np.full(n_items, -1, np.int64)
    for i, a in zip(table.column("item_id").to_pylist(), table.column(id_name).to_pylist()):
        out[i] = a
    return out


def test_mappings_cover_about_99_percent_of_items(tiny):
    n_items = synthetic.SPECS["tiny"].items
    artist = pq.read_table(tiny.artist_mapping)
    album = pq.read_table(tiny.album_mapping)
    for table in (artist, album):
        items = table.column("item_id").to_numpy()
        assert 0.98 < len(np.unique(items)) / n_items < 0.999
        assert items.max() < n_items and 0 in items
    assert 0 in artist.column("artist_id").to_numpy() and 0 in album.column("album_id").to_numpy()
    # An album belongs to one artist, reading each item's last row.
    item_artist = _last_row_wins(artist, "artist_id", n_items)
    item_album = _last_row_wins(album, "album_id", n_items)
    both = (item_artist >= 0) & (item_album >= 0)
    album_artists: dict[int, set[int]] = {}
    for a, b in zip(item_album[both].tolist(), item_artist[both].tolist()):
        album_artists.setdefault(a, set()).add(b)
    assert all(len(s) == 1 for s in album_artists.values())


@pytest.mark.parametrize("id_name", ["artist_id", "album_id"])
def test_some_items_have_several_mapping_rows_and_the_last_wins(tiny, id_name):
    path = tiny.artist_mapping if id_name == "artist_id" else tiny.album_mapping
    table = pq.read_table(path)
    rows: dict[int, list[int]] = {}
    for i, a in zip(table.column("item_id").to_pylist(), table.column(id_name).to_pylist()):
        rows.setdefault(i, []).append(a)
    multi = {i: ids for i, ids in rows.items() if len(ids) > 1}
    assert 0.01 < len(multi) / len(rows) < 0.06, len(multi) / len(rows)
    # The last row is neither the first, nor the smallest, nor the largest id: only "last wins" reads it.
    assert all(ids[-1] != ids[0] and min(ids) < ids[-1] < max(ids) for ids in multi.values())


@pytest.mark.parametrize("size", list(synthetic.SPECS))
def test_uids_reach_the_edge_of_the_presets_uid_table(size):
    cfg = load_config(f"synthetic-{size}")
    assert cfg.dataset.size == size and synthetic.SPECS[size].uid_rows == cfg.sampler.uid_rows
    uids = synthetic.user_ids(synthetic.SPECS[size], SEED)
    assert len(np.unique(uids)) == len(uids) == synthetic.SPECS[size].users and np.all(np.diff(uids) > 0)
    assert uids[0] == 0 and uids[-1] == cfg.sampler.uid_rows - 1


def test_uids_in_the_data_are_sparse_up_to_the_edge(events):
    uids = np.unique(events["uid"])
    spec = synthetic.SPECS["tiny"]
    assert uids.tolist() == synthetic.user_ids(spec, SEED).tolist()
    assert uids.max() == spec.uid_rows - 1 and len(uids) < uids.max() // 10


def _earliest_anchor(events: dict[str, np.ndarray], preset: str) -> tuple[int, int, int]:
    """(train start, earliest anchor, events before the train start) by the reference's rules (docs/data.md)."""
    pre = load_config(preset).preprocess
    uid, ts, et = events["uid"].astype(np.int64), events["timestamp"].astype(np.int64), events["event_type"]
    train_end = int(ts.max()) - pre.test_span_seconds - pre.split_gap_seconds
    train_start = train_end - pre.num_train_days * 86_400
    keep = (ts >= train_start) & (ts < train_end)  # events before the train start never count
    u = uid[keep]
    first = np.flatnonzero(np.r_[True, np.diff(u) != 0])
    local = np.arange(len(u)) - np.repeat(first, np.diff(np.r_[first, len(u)]))
    anchors = (et[keep] == LISTEN) & (local >= pre.min_history)
    return train_start, int(ts[keep][anchors].min()), int(np.sum(ts < train_start))


def test_earliest_anchor_is_days_after_the_train_start(events, tmp_path):
    day = 86_400
    train_start, earliest, before = _earliest_anchor(events, "synthetic-tiny")
    assert earliest >= train_start + day, (earliest - train_start) / day
    assert before > 0  # some users listen before the train start; those events never count
    assert train_start + day <= synthetic.launch_ramp_seconds(synthetic.SPECS["tiny"].days)
    # The preset's own seed too.
    files = synthetic.generate(tmp_path, "tiny", load_config("synthetic-tiny").dataset.synthetic_seed, progress=False)
    table = pq.read_table(files.multi_event, columns=["uid", "timestamp", "event_type"])
    other = {n: table.column(n).to_numpy() for n in ("uid", "timestamp")}
    other["event_type"] = table.column("event_type").combine_chunks().indices.to_numpy().astype(np.int64)
    train_start, earliest, _ = _earliest_anchor(other, "synthetic-tiny")
    assert earliest >= train_start + day, (earliest - train_start) / day


def test_listen_plus_is_predictable_from_recent_history(tiny, events):
    """The signal a sequence model can learn: a recently heard artist predicts listen_plus."""
    artist_map = pq.read_table(tiny.artist_mapping)
    artist_of = np.full(synthetic.SPECS["tiny"].items, -1, np.int64)
    artist_of[artist_map.column("item_id").to_numpy()] = artist_map.column("artist_id").to_numpy()
    listen = events["event_type"] == LISTEN
    uid = events["uid"][listen].astype(np.int64)
    artist = artist_of[events["item_id"][listen]]
    plus = events["played_ratio_pct"][listen] >= 50
    seen = np.zeros(len(uid), bool)
    for back in range(1, 51):
        seen[back:] |= (artist[back:] == artist[:-back]) & (uid[back:] == uid[:-back])
    known = artist >= 0
    gap = plus[seen & known].mean() - plus[~seen & known].mean()
    assert gap >= 0.15, gap
    organic = events["is_organic"][listen] == 1
    assert plus[organic].mean() > plus[~organic].mean()


def test_deterministic_per_seed_and_block_size(tiny, tmp_path, monkeypatch):
    reference = _table_hash(tiny.multi_event)
    again = synthetic.generate(tmp_path / "same", "tiny", SEED, progress=False, workers=1)
    assert _table_hash(again.multi_event) == reference
    assert _table_hash(again.artist_mapping) == _table_hash(tiny.artist_mapping)
    monkeypatch.setattr(synthetic, "BLOCK_LISTENS", 7_000)  # many small blocks, same data
    for workers in (1, 3):  # made in this process, or by 3 worker processes
        blocked = synthetic.generate(tmp_path / f"blocked{workers}", "tiny", SEED, progress=False, workers=workers)
        assert _table_hash(blocked.multi_event) == reference, workers
    other = synthetic.generate(tmp_path / "other", "tiny", SEED + 1, progress=False)
    assert _table_hash(other.multi_event) != reference
    assert _table_hash(other.album_mapping) != _table_hash(tiny.album_mapping)


def test_num_days_override_shrinks_the_span(tmp_path):
    files = synthetic.generate(tmp_path, "tiny", SEED, num_days=3, progress=False)
    ts = pq.read_table(files.multi_event, columns=["timestamp"]).column("timestamp").to_numpy()
    assert ts.max() < 3 * 86_400 + 5
    assert files == RawFiles.under(tmp_path, "tiny")


def test_no_temp_files_left(tiny):
    assert _leftovers(tiny.multi_event.parents[2]) == []


def test_failure_mid_write_leaves_no_final_file(tmp_path, monkeypatch):
    files = RawFiles.under(tmp_path, "tiny")
    files.multi_event.parent.mkdir(parents=True)
    files.multi_event.write_bytes(b"stale events of another seed")

    class FailingWriter(pq.ParquetWriter):
        calls = 0

        def write_table(self, table, row_group_size=None):
            FailingWriter.calls += 1
            if FailingWriter.calls == 2:
                raise RuntimeError("disk gone")
            super().write_table(table, row_group_size=row_group_size)

    monkeypatch.setattr(synthetic, "ROW_GROUP_ROWS", 20_000)
    monkeypatch.setattr(synthetic.pq, "ParquetWriter", FailingWriter)
    with pytest.raises(RuntimeError, match="disk gone"):
        synthetic.generate(tmp_path, "tiny", SEED, num_days=3, progress=False)
    assert FailingWriter.calls == 2
    assert not files.multi_event.exists()
    assert _leftovers(tmp_path) == []


def test_unknown_size_lists_the_sizes(tmp_path):
    with pytest.raises(UserError, match="tiny, small, medium, 50m"):
        synthetic.generate(tmp_path, "huge", SEED, progress=False)


def test_unwritable_root_names_the_path(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(UserError, match="a_file"):
        synthetic.generate(blocker / "data", "tiny", SEED, progress=False)


@pytest.mark.skipif(os.environ.get("DLRMV4_SLOW") != "1", reason="set DLRMV4_SLOW=1 to time the 50m size")
def test_time_50m(tmp_path):
    start = time.perf_counter()
    files = synthetic.generate(tmp_path, "50m", SEED, progress=False)
    seconds = time.perf_counter() - start
    rows = pq.ParquetFile(files.multi_event).metadata.num_rows
    print(f"\nsynthetic 50m: {rows:,} events in {seconds:.1f} s ({rows / seconds / 1e6:.2f} M events/s)")


def test_the_mappings_always_cover_the_last_item():
    """Every seed's artist and album mappings have a row for the catalog's last item: the reference
    (and the preprocessing) refuses events whose items run past a mapping's largest item."""
    from dlrmv4.data.synthetic import _catalog, spec_for

    spec = spec_for("tiny")
    for seed in range(60):  # with the draw alone, some of these seeds leave the last item out
        cat = _catalog(spec, seed)
        for ids, items in (cat.artist_map, cat.album_map):
            assert items.max() == spec.items - 1 and len(ids) == len(items)


# Yambda-5B's listens (the dataset card: 4.65 B of its 4.79 B events).
YAMBDA_5B_LISTENS = 4_650_000_000


def test_synthetic_5b_has_yambda_5b_s_users_catalog_and_span():
    from dlrmv4.reference_counts import YAMBDA_5B_TABLE_COUNTS

    spec = synthetic.SPECS["5b"]
    assert (spec.items, spec.artists, spec.albums) == YAMBDA_5B_TABLE_COUNTS
    assert (spec.users, spec.days, spec.uid_rows) == (1_000_000, 300, 1_000_001)
    # A sample of its users' listen counts: Yambda-5B's mean (4,650 a user) within the sample's spread.
    sample = synthetic.listen_counts("5b", load_config("synthetic-5b").dataset.synthetic_seed, range(0, 1_000_000, 50))
    assert abs(sample.mean() / (YAMBDA_5B_LISTENS / spec.users) - 1) < 0.03, sample.mean()


@pytest.mark.slow
def test_synthetic_5b_draws_yambda_5b_s_listens_past_a_32_bit_row_index():
    """Every user's listen count at the preset's seed (the generator's own draw, without the events): 4.65 B
    listens, within 0.5 %, so its rows (with likes, dislikes and undos) overflow any 32-bit row index."""
    seed = load_config("synthetic-5b").dataset.synthetic_seed
    listens = int(synthetic.listen_counts("5b", seed, range(synthetic.SPECS["5b"].users)).sum())
    assert abs(listens / YAMBDA_5B_LISTENS - 1) < 0.005, listens
    assert listens > 2**32


def test_generation_too_large_for_the_disk_is_refused_before_any_work(tmp_path, monkeypatch):
    import shutil
    from types import SimpleNamespace

    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=10**12, used=0, free=10**9))
    with pytest.raises(
        UserError,
        match=r"^generating synthetic 5b \(about 4,665,000,000 listens\) needs up to "
        r"60\.65 GB under .* but 1\.00 GB are free; free some space",
    ):
        synthetic.generate(tmp_path, "5b", SEED, progress=False)
    assert not any(p.is_file() for p in tmp_path.rglob("*"))
