"""The Yambda download through the real huggingface_hub client (nothing of it is mocked): an offline
cache laid out by hand, and downloads from a loopback fake Hub that drops a transfer half-way."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
from hub_fixtures import COMMIT, FakeHub, build_hub_cache, sha256, yambda_files
from huggingface_hub import constants

from dlrmv4.config import DatasetConfig
from dlrmv4.data.download import download_yambda, validate_revision
from dlrmv4.errors import UserError

SIZE = "50m"
EVENTS = f"flat/{SIZE}/multi_event.parquet"
NAMES = (EVENTS, "artist_item_mapping.parquet", "album_item_mapping.parquet")


def _ds(tmp_path: Path, revision: str = "main", **kwargs: str) -> DatasetConfig:
    fields = {"source": "yambda", "size": SIZE, "data_path": str(tmp_path / "data"), "hub_revision": revision}
    return DatasetConfig(**{**fields, **kwargs})


def _storage(tmp_path: Path) -> Path:
    return (tmp_path / "data" / "hub_cache" / "datasets--yandex--yambda").resolve()


def _one_line_error(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # constants.py reads the variable once at import; is_offline_mode() reads the constant on every call.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def point_at(monkeypatch: pytest.MonkeyPatch):
    """Online mode against a given endpoint, as HF_ENDPOINT would set it at import time."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_IMPLICIT_TOKEN", True)  # no real token to a test server
    # httpx hands http_get whole chunks only (10 MiB by default): small ones let a cut of a small file
    # leave bytes on disk, as a cut of a 50 GB file does.
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 16 * 1024)

    def point(url: str) -> None:
        monkeypatch.setenv("HF_ENDPOINT", url)
        monkeypatch.setattr(constants, "ENDPOINT", url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")

    return point


def _gets(hub: FakeHub, path: str, since: int = 0) -> list[tuple[str | None, int, int]]:
    return [(s.range, s.status, s.body_bytes) for s in hub.seen[since:] if s.method == "GET" and s.path == path]


def test_offline_cache_by_branch_and_commit(tmp_path: Path, offline: None, capsys: pytest.CaptureFixture) -> None:
    files = yambda_files(SIZE, rows=500)
    storage = build_hub_cache(tmp_path / "data" / "hub_cache", files)
    for revision in ("main", COMMIT, COMMIT.upper()):
        raw, commit = download_yambda(_ds(tmp_path, revision), progress=False)
        assert commit == COMMIT
        assert raw.all() == tuple(storage.resolve() / "snapshots" / COMMIT / name for name in NAMES)
        assert [p.read_bytes() for p in raw.all()] == [files[name] for name in NAMES]
        assert pq.read_table(raw.multi_event).num_rows == 500
        warned = "not pinned: results may not be reproducible" in capsys.readouterr().err
        assert warned == (revision == "main")


def test_offline_missing_file_or_revision(tmp_path: Path, offline: None) -> None:
    files = yambda_files(SIZE, rows=100)
    del files["album_item_mapping.parquet"]
    cache = tmp_path / "data" / "hub_cache"
    build_hub_cache(cache, files)
    with pytest.raises(UserError) as excinfo:
        download_yambda(_ds(tmp_path), progress=False)
    message = _one_line_error(excinfo)
    assert message.startswith("album_item_mapping.parquet at revision 'main'")
    assert f"not in the local hub cache {cache}; run with network access (HF_HUB_OFFLINE is set) or copy" in message
    for revision in ("v2", "f" * 40):
        with pytest.raises(UserError, match=f"revision '{revision}' .*not in the local hub cache"):
            download_yambda(_ds(tmp_path, revision), progress=False)


def test_interrupted_download_resumes_on_rerun(tmp_path: Path, point_at) -> None:
    files = yambda_files(SIZE, rows=20_000)
    data = files[EVENTS]
    with FakeHub(files) as hub:
        point_at(hub.url)
        hub.cut_next_get.add(EVENTS)
        hub.down_after_cut = True  # the hub's own retry inside the call meets an outage too
        with pytest.raises(UserError) as excinfo:
            download_yambda(_ds(tmp_path), progress=False)
        assert _one_line_error(excinfo).startswith(f"{EVENTS}: the hub answered HTTP 503; re-run later")
        storage = _storage(tmp_path)
        blob = storage / "blobs" / sha256(data)
        partial = blob.with_name(blob.name + ".incomplete")
        assert not (storage / "snapshots").exists() and not blob.exists()
        have = partial.stat().st_size
        assert 0 < have <= len(data) // 2
        # huggingface_hub's http_get retried inside the call from where it stopped.
        assert _gets(hub, EVENTS) == [(None, 200, len(data) // 2), (f"bytes={have}-", 503, 0)]

        hub.down = False
        seen_before = len(hub.seen)
        raw, commit = download_yambda(_ds(tmp_path), progress=False)
        # The re-run asked only for the missing tail.
        assert _gets(hub, EVENTS, seen_before) == [(f"bytes={have}-", 206, len(data) - have)]
        assert commit == COMMIT
        assert [p.read_bytes() for p in raw.all()] == [files[name] for name in NAMES]
        # hf_hub_download adopted the blob: the layout is the hub's own.
        assert raw.multi_event == storage / "snapshots" / COMMIT / EVENTS
        assert raw.multi_event.resolve() == blob and not partial.exists()
        assert (storage / "refs" / "main").read_text() == COMMIT

        # A pinned commit that is cached needs no request at all.
        seen_before = len(hub.seen)
        assert download_yambda(_ds(tmp_path, COMMIT), progress=False) == (raw, COMMIT)
        assert hub.seen[seen_before:] == []


def test_corrupt_partial_is_caught_by_the_sha256_etag(tmp_path: Path, point_at) -> None:
    files = yambda_files(SIZE, rows=2_000)
    data = files[EVENTS]
    partial = _storage(tmp_path) / "blobs" / f"{sha256(data)}.incomplete"
    partial.parent.mkdir(parents=True)
    partial.write_bytes(b"x" * (len(data) // 3))  # not a prefix of the file: resuming it gives wrong bytes
    with FakeHub(files) as hub:
        point_at(hub.url)
        with pytest.raises(UserError, match=f"{EVENTS}: downloaded bytes do not match the hub's sha256"):
            download_yambda(_ds(tmp_path), progress=False)
        assert not partial.exists()
        raw, _ = download_yambda(_ds(tmp_path), progress=False)
        assert raw.multi_event.read_bytes() == data
        assert [r for r, _, _ in _gets(hub, EVENTS)] == [f"bytes={len(data) // 3}-", None]


def test_transient_cut_is_resumed_inside_one_call(tmp_path: Path, point_at) -> None:
    files = yambda_files(SIZE, rows=20_000)
    data = files[EVENTS]
    with FakeHub(files) as hub:
        point_at(hub.url)
        hub.cut_next_get.add(EVENTS)
        raw, _ = download_yambda(_ds(tmp_path), progress=True)
        (_, _, first), (resume_range, status, rest) = _gets(hub, EVENTS)
        assert first == len(data) // 2 and status == 206 and resume_range == f"bytes={len(data) - rest}-"
        assert raw.multi_event.read_bytes() == data


def test_online_errors_are_one_line(tmp_path: Path, point_at) -> None:
    files = yambda_files(SIZE, rows=100)
    with FakeHub(files) as hub:
        point_at(hub.url)
        cases = [
            (_ds(tmp_path, "nope"), f"{EVENTS}: revision 'nope' not found in dataset yandex/yambda"),
            (_ds(tmp_path, hub_repo_id="nobody/none"), f"{EVENTS}: dataset repo 'nobody/none' not found"),
            (_ds(tmp_path, size="500m"), "flat/500m/multi_event.parquet not found in dataset yandex/yambda"),
        ]
        for ds, start in cases:
            with pytest.raises(UserError) as excinfo:
                download_yambda(ds, progress=False)
            assert _one_line_error(excinfo).startswith(start)


def test_network_failure_uses_cache_or_explains(tmp_path: Path, point_at) -> None:
    with socket.socket() as sock:  # a loopback port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    point_at(f"http://127.0.0.1:{port}")
    with pytest.raises(UserError) as excinfo:
        download_yambda(_ds(tmp_path), progress=False)
    assert _one_line_error(excinfo).startswith(f"{EVENTS}: network failure talking to http://127.0.0.1:{port}")
    files = yambda_files(SIZE, rows=100)
    build_hub_cache(tmp_path / "data" / "hub_cache", files)
    raw, commit = download_yambda(_ds(tmp_path), progress=False)  # falls back to refs/main, as the hub does
    assert commit == COMMIT and raw.multi_event.read_bytes() == files[EVENTS]


def test_disk_space_is_checked_before_downloading(tmp_path: Path, point_at, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each file checks its own room too: the disk filled up after the whole download's check."""
    frees = iter([10**12])  # the first look (the whole download's) finds room; every later one does not
    with FakeHub(yambda_files(SIZE, rows=100)) as hub:
        point_at(hub.url)
        monkeypatch.setattr(
            shutil, "disk_usage", lambda path: SimpleNamespace(total=10**12, used=0, free=next(frees, 10))
        )
        with pytest.raises(UserError, match=f"{EVENTS}: needs .* GB more but .* GB free; free some space"):
            download_yambda(_ds(tmp_path), progress=False)
        assert _gets(hub, EVENTS) == []


def test_unwritable_cache(tmp_path: Path, point_at) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data").chmod(0o500)
    try:
        (tmp_path / "data" / "probe").touch()
        pytest.skip("file permissions are not enforced for this user (root)")
    except PermissionError:
        pass
    with FakeHub(yambda_files(SIZE, rows=100)) as hub:
        point_at(hub.url)
        with pytest.raises(UserError, match=f"{EVENTS}: cannot write .*fix the permissions"):
            download_yambda(_ds(tmp_path), progress=False)


def test_validate_revision(capsys: pytest.CaptureFixture) -> None:
    assert validate_revision(COMMIT.upper()) == COMMIT
    assert "warning" not in capsys.readouterr().err
    for ref in ("main", "v1.0", "refs/pr/3"):
        assert validate_revision(ref) == ref
        assert f"dataset.hub_revision={ref!r} is a branch or tag, not pinned" in capsys.readouterr().err
    for bad in ("", "a..b", "-x", "a b", "/main", "main/", "x.lock"):
        with pytest.raises(UserError, match="is not a branch, tag or 40-hex commit"):
            validate_revision(bad)


def test_config_values_are_checked(tmp_path: Path, offline: None) -> None:
    with pytest.raises(UserError, match="dataset.size='tiny' is not a Yambda size; choose one of 50m, 500m, 5b"):
        download_yambda(_ds(tmp_path, size="tiny"), progress=False)
    with pytest.raises(UserError, match="dataset.hub_repo_id='not a repo' is not a valid repo id"):
        download_yambda(_ds(tmp_path, hub_repo_id="not a repo"), progress=False)


def test_relative_data_path(tmp_path: Path, offline: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    build_hub_cache(tmp_path / "data" / "hub_cache", yambda_files(SIZE, rows=100))
    raw, commit = download_yambda(_ds(Path(".")), progress=False)
    assert commit == COMMIT and raw.multi_event == _storage(tmp_path) / "snapshots" / COMMIT / EVENTS


def test_the_whole_download_is_checked_for_space_first(tmp_path: Path, point_at, monkeypatch) -> None:
    """Room for the largest file but not for all three: refused before any file is fetched, in one
    line naming what all of them need and what is free; a partial blob counts as already there."""
    files = yambda_files(SIZE, rows=100)
    need = sum(len(files[name]) for name in NAMES)
    with FakeHub(files) as hub:
        point_at(hub.url)
        free = need - 1
        monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=10**12, used=0, free=free))
        with pytest.raises(UserError) as excinfo:
            download_yambda(_ds(tmp_path), progress=False)
        message = _one_line_error(excinfo)
        assert message.startswith(f"downloading Yambda-50M (3 files) needs up to {need / 1e9:.2f} GB under ")
        assert f"but {free / 1e9:.2f} GB are free" in message
        assert [s for s in hub.seen if s.method == "GET"] == []
        partial = _storage(tmp_path) / "blobs" / f"{sha256(files[EVENTS])}.incomplete"
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_bytes(files[EVENTS][:10])  # ten bytes already on disk: now it fits
        raw, _ = download_yambda(_ds(tmp_path), progress=False)
        assert raw.multi_event.read_bytes() == files[EVENTS]
