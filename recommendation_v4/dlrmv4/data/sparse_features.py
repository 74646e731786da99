"""A batch's id features, named as the embedding lookup names them.

``history_<name>_id`` (one id per history token, jagged by the batch's history lengths) and
``candidate_<name>_id`` (one per sample) for each id the history and the candidate share, and one
feature per contextual column (one id per sample, ``hashing.CONTEXTUAL_FEATURES`` order).
``sparse_features`` gives them as TorchRec's KeyedJaggedTensor, in ``SPARSE_KEYS`` order: for a
batch the loader's worker packed (``TorchJaggedBatch.id_lengths`` set) its values and lengths are
the batch's own memory, already on the device; otherwise they are gathered. A batch packed with its
ids deduplicated (``lookup_ids`` set) gives each history feature's distinct ids instead, counted
over its samples evenly (which sample an id counts for does not matter): the lookup returns one row
per distinct id, and ``sequence_rows`` gives every token its row.
"""

from __future__ import annotations

import torch

from dlrmv4.data.batch import HISTORY_ID_FIELDS, ID_FIELDS, TorchJaggedBatch
from dlrmv4.data.hashing import CONTEXTUAL_FEATURES
from dlrmv4.ops.gather_rows import gather_rows

# Ids that both the history and the candidate carry (each indexes one table for both).
SHARED_IDS = ("item", "artist", "album")
# The lookup's features, in the order of its tables (history then candidate for a shared one).
SPARSE_KEYS = tuple(f"{side}_{name}_id" for name in SHARED_IDS for side in ("history", "candidate")) + tuple(
    CONTEXTUAL_FEATURES
)
assert SPARSE_KEYS[: len(ID_FIELDS) - 1] == ID_FIELDS[:-1]  # the batch packs its ids in this order
HISTORY_KEYS = tuple(f"history_{name}_id" for name in SHARED_IDS)
assert HISTORY_KEYS == HISTORY_ID_FIELDS  # the order of the batch's unique_counts and history_inverse


def feature_ids(batch: TorchJaggedBatch) -> dict[str, torch.Tensor]:
    """Every id feature of a batch, in ``SPARSE_KEYS`` order."""
    ids = {}
    for name in SHARED_IDS:
        ids[f"history_{name}_id"] = getattr(batch, f"history_{name}_id")
        ids[f"candidate_{name}_id"] = getattr(batch, f"candidate_{name}_id")
    for c, name in enumerate(CONTEXTUAL_FEATURES):
        ids[name] = batch.contextual_ids[:, c]
    return ids


def sparse_features(batch: TorchJaggedBatch):
    """Every id feature as one KeyedJaggedTensor in ``SPARSE_KEYS`` order: a history feature has the
    history lengths, every other one id per sample. Host-side sizes per key spare TorchRec a
    device-to-host sync."""
    from torchrec import KeyedJaggedTensor

    b, t = batch.num_samples, batch.total_tokens
    if batch.lookup_ids is not None and batch.unique_counts is not None and batch.id_lengths is not None:
        distinct = dict(zip(HISTORY_KEYS, batch.unique_counts))
        per_key = [distinct.get(k, b) for k in SPARSE_KEYS]
        return KeyedJaggedTensor(
            keys=list(SPARSE_KEYS), values=batch.lookup_ids, lengths=batch.id_lengths, stride=b, length_per_key=per_key
        )
    per_key = [t if k.startswith("history_") else b for k in SPARSE_KEYS]
    packed = packed_ids(batch)
    if packed is not None and batch.id_lengths is not None:
        values, lengths = packed, batch.id_lengths
    else:
        ids = feature_ids(batch)
        values = torch.cat([ids[k] for k in SPARSE_KEYS])
        # int64 lengths: TorchRec's row-wise sequence all-to-all permutes the looked-up rows by
        # lengths x embedding dim (FBGEMM's permute_2D_sparse_data), which overflows int32 past 2**31
        # elements: at 1,024 samples per rank and D = 512 a rank's rows hold several times that.
        ones = torch.ones(b, dtype=torch.int64, device=batch.history_lengths.device)
        history = batch.history_lengths.to(torch.int64)
        lengths = torch.cat([history if k.startswith("history_") else ones for k in SPARSE_KEYS])
    return KeyedJaggedTensor(keys=list(SPARSE_KEYS), values=values, lengths=lengths, stride=b, length_per_key=per_key)


def lookup_size(batch: TorchJaggedBatch) -> int:
    """How many ids ``sparse_features(batch)`` asks the lookup for (host sizes, no device read)."""
    b = batch.num_samples
    history = (
        sum(batch.unique_counts)
        if batch.lookup_ids is not None and batch.unique_counts
        else len(HISTORY_KEYS) * batch.total_tokens
    )
    return history + (len(SPARSE_KEYS) - len(HISTORY_KEYS)) * b


def sequence_rows(
    batch: TorchJaggedBatch,
    rows: dict[str, torch.Tensor],
    table: str,
    dtype: torch.dtype,
    kernels: str = "auto",
    chunks: tuple[tuple[int, int], ...] = (),
) -> torch.Tensor:
    """Table ``table``'s looked-up rows (``rows`` by feature) as the sequence model takes them, in
    ``dtype``: every history token's row, then every candidate's ([T + B, E]) for a shared table,
    chunk after chunk for the sample ranges ``chunks`` (``SequenceEmbeddings.chunks``); the
    feature's rows ([B, E]) for a contextual one. In a deduplicated batch the history feature's rows
    are its distinct ids': one gather picks each token's row and places the candidates' after them
    (the chunks' order is the gather's index), so no [T, E] tensor is copied twice. Its backward
    sums a distinct row's token gradients (``ops/gather_rows.py``: sorted, deterministic, in the
    layout's order; ``kernels`` is the model's choice) before the lookup's backward sends them."""
    if table not in SHARED_IDS:
        return rows[table].to(dtype)
    history, candidate = (rows[f"{side}_{table}_id"].to(dtype) for side in ("history", "candidate"))
    ranges = chunks or ((0, batch.num_samples),)

    def laid_out(tokens: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        pieces = []
        for start, stop in ranges:
            pieces += [tokens[batch.history_row(start) : batch.history_row(stop)], candidates[start:stop]]
        return torch.cat(pieces)

    if batch.lookup_ids is None or batch.history_inverse is None:
        return laid_out(history, candidate)
    inverse = batch.history_inverse[SHARED_IDS.index(table)]
    distinct = history.shape[0]
    candidates = torch.arange(distinct, distinct + candidate.shape[0], device=inverse.device, dtype=inverse.dtype)
    return gather_rows(torch.cat([history, candidate]), laid_out(inverse, candidates), kernels)


def packed_ids(batch: TorchJaggedBatch) -> torch.Tensor | None:
    """The one int64 region that holds every id of ``batch`` in ``SPARSE_KEYS`` order (as
    ``JaggedBatch.to_torch`` lays it out), or None where the id fields are not laid out so (a batch
    cut by ``samples``, or one whose fields were replaced)."""
    first = batch.history_item_id
    if first.dtype != torch.int64 or not first.is_contiguous():
        return None
    b, expected = batch.num_samples, first.data_ptr()
    for name in ID_FIELDS[:-1]:
        t = getattr(batch, name)
        if t.dtype != torch.int64 or t.data_ptr() != expected or not t.is_contiguous() or t.dim() != 1:
            return None
        expected += t.numel() * 8
    ctx = batch.contextual_ids
    if ctx.data_ptr() != expected or ctx.dtype != torch.int64 or ctx.stride() != (1, b) or b == 0:
        return None
    if ctx.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
        return None
    total = (expected - first.data_ptr()) // 8 + ctx.numel()
    return torch.empty(0, dtype=torch.int64, device=first.device).set_(
        first.untyped_storage(), first.storage_offset(), (total,), (1,)
    )
