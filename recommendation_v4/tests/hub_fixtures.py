"""Test helpers: small Yambda-schema parquet files, a huggingface_hub cache laid out by hand, and a
loopback HTTP server that answers the part of the Hub API ``hf_hub_download`` uses for a dataset."""

from __future__ import annotations

import hashlib
import os
import re
import socket
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dlrmv4.data.yambda_schema import EVENT_TYPES, MULTI_EVENT_SCHEMA, RawFiles

REPO_ID = "yandex/yambda"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    # Uncompressed, so the byte size (and the half-way cut of the resume test) is predictable.
    pq.write_table(table, sink, compression="none")
    return sink.getvalue().to_pybytes()


def yambda_files(size: str, rows: int, seed: int = 0) -> dict[str, bytes]:
    """The three raw files of ``size`` as repo path -> parquet bytes, in the Yambda schema."""
    rng = np.random.default_rng(seed)
    items = rng.integers(1, 1_000, rows, dtype=np.uint32)
    codes = rng.integers(0, len(EVENT_TYPES), rows, dtype=np.int8)
    listen = codes == 0
    events = pa.table(
        {
            "uid": np.sort(rng.integers(1, 50, rows, dtype=np.uint32)),
            "item_id": items,
            "timestamp": np.arange(rows, dtype=np.uint32) * 5,
            "is_organic": rng.integers(0, 2, rows, dtype=np.uint8),
            "event_type": pa.DictionaryArray.from_arrays(pa.array(codes), pa.array(EVENT_TYPES)),
            "played_ratio_pct": pa.array(rng.integers(0, 120, rows, dtype=np.uint16), mask=~listen),
            "track_length_seconds": pa.array(rng.integers(30, 600, rows, dtype=np.uint32), mask=~listen),
        },
        schema=MULTI_EVENT_SCHEMA,
    )
    catalog = np.arange(1, 1_000, dtype=np.uint32)
    artists = pa.table({"artist_id": catalog // 7, "item_id": catalog})
    albums = pa.table({"album_id": catalog // 3, "item_id": catalog})
    names = RawFiles.hub_names(size)
    return dict(zip(names, map(_parquet_bytes, (events, artists, albums))))


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def build_hub_cache(
    cache_dir: Path,
    files: dict[str, bytes],
    *,
    commit: str = COMMIT,
    refs: tuple[str, ...] = ("main",),
    repo_id: str = REPO_ID,
) -> Path:
    """Lay ``files`` out as huggingface_hub does: blobs named by etag (sha256 for LFS files), relative
    snapshot symlinks, and ``refs/<name>`` holding the commit (no newline). Returns the repo folder."""
    storage = cache_dir / ("datasets--" + repo_id.replace("/", "--"))
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    for path, data in files.items():
        blob = storage / "blobs" / sha256(data)
        blob.write_bytes(data)
        link = storage / "snapshots" / commit / path
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (storage / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (storage / "refs" / ref).write_text(commit)
    return storage


@dataclass
class Seen:
    method: str
    path: str
    range: str | None
    status: int
    body_bytes: int


class FakeHub:
    """HEAD/GET ``/datasets/<repo>/resolve/<revision>/<path>`` on 127.0.0.1, plain HTTP (no ``X-Xet-*``
    headers, so the client downloads the bytes itself), with ``Range`` support.

    ``cut_next_get`` holds paths whose next GET sends the full Content-Length but only half the body and
    then drops the connection; with ``down_after_cut`` every later request gets 503 until ``down`` is
    cleared, so the client's own in-call retry fails too. The server stops itself after ``max_seconds``.
    """

    def __init__(
        self,
        files: dict[str, bytes],
        *,
        repo_id: str = REPO_ID,
        commit: str = COMMIT,
        branches: tuple[str, ...] = ("main",),
        max_seconds: float = 30.0,
    ):
        self.files, self.repo_id, self.commit, self.branches = files, repo_id, commit, branches
        self.max_seconds = max_seconds
        self.cut_next_get: set[str] = set()
        self.down_after_cut = False
        self.down = False
        self.seen: list[Seen] = []
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> "FakeHub":
        handler = type("Handler", (_Handler,), {"hub": self})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self._timer = threading.Timer(self.max_seconds, self._server.shutdown)
        self._timer.daemon = True
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def record(self, seen: Seen) -> None:
        with self._lock:
            self.seen.append(seen)


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"
    timeout = 10  # an idle keep-alive connection must not hold a thread forever

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def do_GET(self) -> None:
        self._answer(head=False)

    def _reply(
        self, status: int, headers: dict[str, str], body: bytes = b"", *, head: bool, path: str = "", cut: bool = False
    ) -> None:
        sent = body[: len(body) // 2] if cut else body
        # Recorded before answering, so the client never sees a reply the log does not hold yet.
        self.hub.record(Seen(self.command, path, self.headers.get("Range"), status, 0 if head else len(sent)))
        self.send_response(status)
        for key, value in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(key, value)
        self.end_headers()
        if not head:
            self.wfile.write(sent)
        if cut:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True

    def _answer(self, *, head: bool) -> None:
        hub = self.hub
        prefix = f"/datasets/{hub.repo_id}/resolve/"
        in_repo = self.path.startswith(prefix)
        quoted_rev, _, quoted_path = self.path[len(prefix) :].partition("/") if in_repo else ("", "", self.path)
        revision, path = unquote(quoted_rev), unquote(quoted_path)
        if hub.down:
            return self._reply(503, {}, head=head, path=path)
        if not in_repo:
            return self._reply(404, {"X-Error-Code": "RepoNotFound"}, head=head, path=path)
        if revision not in (*hub.branches, hub.commit):
            return self._reply(404, {"X-Error-Code": "RevisionNotFound"}, head=head, path=path)
        common = {"X-Repo-Commit": hub.commit}
        if path not in hub.files:
            return self._reply(404, {**common, "X-Error-Code": "EntryNotFound"}, head=head, path=path)
        data = hub.files[path]
        common |= {"ETag": f'"{sha256(data)}"', "Accept-Ranges": "bytes"}
        start = 0
        match = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
        if match and not head:
            start = int(match.group(1))
            if start >= len(data):
                return self._reply(416, {**common, "Content-Range": f"bytes */{len(data)}"}, head=head, path=path)
        cut = not head and path in hub.cut_next_get
        if cut:
            hub.cut_next_get.discard(path)
            hub.down = hub.down_after_cut
        if start:
            common["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        self._reply(206 if start else 200, common, data[start:], head=head, path=path, cut=cut)
