"""Download the raw Yambda files (docs/data.md) into a huggingface_hub cache, resumably.

huggingface_hub 2.4.0 writes each blob to a process-unique ``blobs/<etag>.<uuid8>.incomplete`` that it
deletes on any failure (``file_download._download_to_tmp_and_move``), so an interrupted run starts a
50 GB file over; its ``http_get`` resumes with a ``Range`` request only inside one call, after a transient
network error. So for plain-HTTP files we keep ``blobs/<etag>.incomplete`` across runs and continue it
with the hub's own ``http_get(resume_size=...)``; ``hf_hub_download`` then adopts the finished blob (it
writes the snapshot symlink and ``refs/<revision>`` as usual). Files above the hub's plain-HTTP limit go
through ``hf_hub_download`` (Xet) unchanged.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import sys
from pathlib import Path
from urllib.parse import urlsplit

import httpx2
from huggingface_hub import constants, get_hf_file_metadata, hf_hub_download, hf_hub_url, try_to_load_from_cache
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import HfFileMetadata, http_get, repo_folder_name
from huggingface_hub.utils import WeakFileLock, build_hf_headers
from huggingface_hub.utils.sha import sha_fileobj
from huggingface_hub.utils.tqdm import silent_tqdm

from dlrmv4.config import YAMBDA_SIZES, DatasetConfig
from dlrmv4.data.paths import hub_cache_dir
from dlrmv4.data.yambda_schema import RawFiles
from dlrmv4.errors import UserError
from dlrmv4.files import check_free_space

REPO_TYPE = "dataset"
_COMMIT = re.compile(r"[0-9a-fA-F]{40}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
# A conservative subset of git ref names: branches, tags, refs/pr/N.
_REF = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*(/[A-Za-z0-9_][A-Za-z0-9._-]*)*")


def validate_revision(rev: str) -> str:
    """The revision to download: a 40-hex commit (lower-cased) or a branch/tag name, which gets a warning."""
    if _COMMIT.fullmatch(rev):
        return rev.lower()
    if not _REF.fullmatch(rev) or ".." in rev or rev.endswith((".", ".lock")):
        raise UserError(f"config field dataset.hub_revision={rev!r} is not a branch, tag or 40-hex commit")
    print(
        f"warning: dataset.hub_revision={rev!r} is a branch or tag, not pinned: results may not be "
        "reproducible (pass a 40-hex commit with --hub-revision)",
        file=sys.stderr,
    )
    return rev


def download_yambda(ds: DatasetConfig, *, progress: bool = True) -> tuple[RawFiles, str]:
    """Fetch the three raw files of ``ds.size``; return their snapshot paths and the resolved commit sha."""
    if ds.size not in YAMBDA_SIZES:
        raise UserError(
            f"config field dataset.size={ds.size!r} is not a Yambda size; choose one of {', '.join(YAMBDA_SIZES)}"
        )
    revision = validate_revision(ds.hub_revision)
    # Absolute, as hf_hub_download makes it: the returned paths and the snapshot folder then agree.
    cache = hub_cache_dir(ds).expanduser().resolve()
    tqdm_class = None if progress else silent_tqdm
    names = RawFiles.hub_names(ds.size)
    to_fetch = _bytes_to_fetch(ds.hub_repo_id, revision, names, cache)
    if to_fetch:
        check_free_space(cache, to_fetch, f"downloading Yambda-{ds.size.upper()} ({len(names)} files)")
    paths = [Path(_download_file(ds.hub_repo_id, revision, name, cache, tqdm_class, progress)) for name in names]
    snapshots = cache / repo_folder_name(repo_id=ds.hub_repo_id, repo_type=REPO_TYPE) / "snapshots"
    commits = sorted({p.relative_to(snapshots).parts[0] for p in paths})
    if len(commits) != 1:
        raise UserError(
            f"revision {revision!r} of {ds.hub_repo_id} moved during the download (commits "
            f"{', '.join(commits)}); pin one with --hub-revision and re-run"
        )
    return RawFiles(multi_event=paths[0], artist_mapping=paths[1], album_mapping=paths[2]), commits[0]


def _download_file(
    repo_id: str, revision: str, filename: str, cache: Path, tqdm_class: type | None, progress: bool
) -> str:
    def download() -> str:
        return hf_hub_download(
            repo_id=repo_id,
            filename=filename,
            repo_type=REPO_TYPE,
            revision=revision,
            cache_dir=cache,
            tqdm_class=tqdm_class,
        )

    try:
        # Offline, or a pinned commit already cached: the hub answers from the cache without a request.
        if constants.is_offline_mode() or (_COMMIT.fullmatch(revision) and _cached(repo_id, revision, filename, cache)):
            return download()
        url = hf_hub_url(repo_id, filename, repo_type=REPO_TYPE, revision=revision)
        try:
            meta = get_hf_file_metadata(url)
        except (RepositoryNotFoundError, RevisionNotFoundError, RemoteEntryNotFoundError):
            raise
        except (HfHubHTTPError, httpx2.TransportError):
            # Hub unreachable or failing: like hf_hub_download, fall back to the copy cached for this revision.
            cached = _cached(repo_id, revision, filename, cache)
            if cached is None:
                raise
            return cached
        if meta.commit_hash is None or meta.etag is None:
            raise UserError(
                f"{filename}: {constants.ENDPOINT} did not answer like a Hugging Face Hub (no "
                "X-Repo-Commit/ETag header); check HF_ENDPOINT and your proxy settings"
            )
        storage = cache / repo_folder_name(repo_id=repo_id, repo_type=REPO_TYPE)
        if meta.size is not None and meta.size <= constants.MAX_HTTP_DOWNLOAD_SIZE:
            _fetch_blob(url, filename, meta, storage, cache, tqdm_class, progress)
        return download()
    except (HfHubHTTPError, LocalEntryNotFoundError, HFValidationError, httpx2.TransportError, OSError) as exc:
        raise UserError(_explain(exc, repo_id, revision, filename, cache)) from exc


def _bytes_to_fetch(repo_id: str, revision: str, names: tuple[str, ...], cache: Path) -> int | None:
    """Bytes the download of ``names`` still has to write: the files not in the cache, less what
    their partial blobs hold. None where the hub does not say (offline, unreachable, no sizes): each
    file's own download then reports that, and checks its own space."""
    if constants.is_offline_mode():
        return None
    storage = cache / repo_folder_name(repo_id=repo_id, repo_type=REPO_TYPE)
    total = 0
    for name in names:
        if _COMMIT.fullmatch(revision) and _cached(repo_id, revision, name, cache):
            continue
        try:
            meta = get_hf_file_metadata(hf_hub_url(repo_id, name, repo_type=REPO_TYPE, revision=revision))
        except (HfHubHTTPError, LocalEntryNotFoundError, HFValidationError, httpx2.TransportError, OSError):
            return None
        if meta.size is None or meta.etag is None:
            return None
        blob = storage / "blobs" / meta.etag
        if blob.exists():
            continue
        partial = blob.with_name(blob.name + ".incomplete")
        total += meta.size - (partial.stat().st_size if partial.exists() else 0)
    return total


def _cached(repo_id: str, revision: str, filename: str, cache: Path) -> str | None:
    found = try_to_load_from_cache(repo_id, filename, cache_dir=cache, revision=revision, repo_type=REPO_TYPE)
    return found if isinstance(found, str) else None


def _fetch_blob(
    url: str, filename: str, meta: HfFileMetadata, storage: Path, cache: Path, tqdm_class: type | None, progress: bool
) -> None:
    """Bring ``blobs/<etag>`` into the cache, continuing the ``.incomplete`` file an earlier run left."""
    assert meta.etag is not None and meta.size is not None  # the caller checked both
    blob = storage / "blobs" / meta.etag
    partial = blob.with_name(blob.name + ".incomplete")
    # The hub locks the same file around its own download of this blob.
    lock = cache / ".locks" / storage.name / f"{meta.etag}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    blob.parent.mkdir(parents=True, exist_ok=True)
    with WeakFileLock(lock):
        if blob.exists():
            return
        have = partial.stat().st_size if partial.exists() else 0
        if have > meta.size:  # not a prefix of this blob: start over
            partial.unlink()
            have = 0
        free = shutil.disk_usage(blob.parent).free
        if free < meta.size - have:
            raise UserError(
                f"{filename}: needs {(meta.size - have) / 1e9:.2f} GB more but {blob.parent} has "
                f"{free / 1e9:.2f} GB free; free some space or point --data-path at a larger disk"
            )
        # Like the hub: the token goes to the hub host only, never to a CDN it redirects to.
        same_host = urlsplit(meta.location).netloc == urlsplit(url).netloc
        with open(partial, "ab") as f:
            http_get(
                meta.location,
                f,
                resume_size=have,
                headers=build_hf_headers(token=None if same_host else False),
                expected_size=meta.size,
                displayed_filename=filename,
                tqdm_class=tqdm_class,
            )
        if _SHA256.fullmatch(meta.etag):  # LFS blobs are named by their sha256: check the resumed bytes
            if progress:
                print(f"verifying sha256 of {filename}", file=sys.stderr)
            with open(partial, "rb") as f:
                digest = sha_fileobj(f).hex()
            if digest != meta.etag:
                partial.unlink()
                raise UserError(
                    f"{filename}: downloaded bytes do not match the hub's sha256 {meta.etag}; "
                    "the partial file was removed, re-run to download it again"
                )
        os.replace(partial, blob)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _explain(exc: BaseException, repo_id: str, revision: str, filename: str, cache: Path) -> str:
    """One line that says what failed for ``filename`` and what to do."""
    if isinstance(exc, GatedRepoError):
        return (
            f"{filename}: dataset {repo_id} is gated; accept its terms on the Hub and log in "
            "(hf auth login or HF_TOKEN)"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return (
            f"{filename}: dataset repo {repo_id!r} not found or not accessible; check dataset.hub_repo_id "
            "(--hub-repo-id) and your token"
        )
    if isinstance(exc, RevisionNotFoundError):
        return (
            f"{filename}: revision {revision!r} not found in dataset {repo_id}; check dataset.hub_revision "
            "(--hub-revision)"
        )
    if isinstance(exc, RemoteEntryNotFoundError):
        return (
            f"{filename} not found in dataset {repo_id} at revision {revision!r}; check dataset.size and "
            "dataset.hub_revision"
        )
    if isinstance(exc, LocalEntryNotFoundError):
        if not constants.is_offline_mode():
            return (
                f"{filename}: the hub could not be reached and the file is not in the local hub cache "
                f"{cache}; check the network and re-run"
            )
        storage = cache / repo_folder_name(repo_id=repo_id, repo_type=REPO_TYPE)
        known = (storage / ("snapshots" if _COMMIT.fullmatch(revision) else "refs") / revision).exists()
        what = f"{filename} at revision {revision!r}" if known else f"revision {revision!r} (for {filename})"
        return (
            f"{what} of dataset {repo_id} is not in the local hub cache {cache}; run with network access "
            "(HF_HUB_OFFLINE is set) or copy the cache"
        )
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else "error"
        return f"{filename}: the hub answered HTTP {status}; re-run later, the download resumes where it stopped"
    if isinstance(exc, httpx2.TransportError):
        return (
            f"{filename}: network failure talking to {constants.ENDPOINT} ({type(exc).__name__}: "
            f"{_one_line(exc)}); check the connection (HF_ENDPOINT, proxy) and re-run, the download resumes"
        )
    if isinstance(exc, HFValidationError):
        return f"config field dataset.hub_repo_id={repo_id!r} is not a valid repo id: {_one_line(exc)}"
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return (
            f"{filename}: disk full under {cache}; free some space or point --data-path at a larger disk, "
            "then re-run to resume"
        )
    if isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return (
            f"{filename}: cannot write {exc.filename or cache} ({exc.strerror}); fix the permissions or "
            "point --data-path elsewhere"
        )
    return f"{filename}: download failed ({_one_line(exc)}); re-run to resume"
