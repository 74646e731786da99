"""Contextual features: the reference's xxh64 crosses (golden values) and the raw-uid rule."""

from __future__ import annotations

import numpy as np
import pytest
from reference_sampler import py_contextual, py_cross

from dlrmv4.config import SamplerConfig
from dlrmv4.data.hashing import CONTEXTUAL_FEATURES, CROSSES, contextual_ids, hash_rows, table_rows
from dlrmv4.errors import UserError

# (keys, rows, row): the reference's xxhash_cross with salt/seed 0 (docs/data.md).
GOLDEN = [
    ((1, 2), 1000, 524),
    ((1, 2), 2**30, 1_056_167_084),
    ((42, 7), 10**6, 924_376),
    ((0, 0), 1000, 434),
    ((-1, -1), 1000, 28),
    ((1, 2, 3), 1000, 706),
    ((1, 2, 3), 2**30, 633_392_634),
    ((42, 7, 15), 10**6, 847_584),
    ((1, 2, 3, 4), 1000, 45),
    ((3, 2, 1), 1000, 313),
]


@pytest.mark.parametrize("keys,rows,row", GOLDEN)
def test_golden_values(keys, rows, row):
    assert py_cross(keys, rows) == row
    assert hash_rows(np.array([keys], dtype=np.int64), rows).tolist() == [row]


def test_golden_values_in_one_batch():
    # A batch of one width hashes each row independently of its neighbours.
    pairs = [g for g in GOLDEN if len(g[0]) == 2 and g[1] == 1000]
    keys = np.array([k for k, _, _ in pairs], dtype=np.int64)
    assert hash_rows(keys, 1000).tolist() == [r for _, _, r in pairs]


@pytest.mark.parametrize("width", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_vectorised_equals_struct_pack(width, seed):
    rng = np.random.default_rng(seed)
    n = 300
    # Negative, small, > 2**32 and extreme int64 values, in every key position.
    keys = np.concatenate(
        [
            rng.integers(-(2**63), 2**63 - 1, (n, width), dtype=np.int64, endpoint=True),
            rng.integers(-5, 2**33, (n, width), dtype=np.int64),
            np.array([[-(2**63)] * width, [2**63 - 1] * width, [0] * width], dtype=np.int64),
        ]
    )
    for rows in (1, 7, 1000, 2**30, 2**62 + 11):
        got = hash_rows(keys, rows)
        assert got.dtype == np.int64
        assert got.tolist() == [py_cross(tuple(int(v) for v in k), rows) for k in keys]


def test_non_contiguous_and_narrow_inputs():
    rng = np.random.default_rng(3)
    wide = rng.integers(0, 2**32, (50, 4), dtype=np.int64)
    strided = wide[::2, [3, 1]]  # a fancy-indexed, strided view
    assert hash_rows(strided, 1000).tolist() == [py_cross(tuple(map(int, k)), 1000) for k in strided]
    narrow = wide[:, :2].astype(np.uint32)  # uint32 inputs are packed as their int64 values
    assert hash_rows(narrow, 1000).tolist() == hash_rows(wide[:, :2], 1000).tolist()
    with pytest.raises(ValueError, match=r"\[n, k\]"):
        hash_rows(np.zeros(3, dtype=np.int64), 10)


def test_contextual_ids_follow_the_reference():
    cfg = SamplerConfig()
    inputs = dict(
        uid=[0, 1, 123456, 1_000_000],
        item=[0, 7, 9_390_622, 4_294_967_295],
        artist=[0, 3, 1_293_394, 4_294_967_295],
        album=[0, 5, 3_367_691, 4_294_967_295],
        timestamp=[0, 3_600, 25_999_999, 4_294_967_295],
        is_organic=[0, 1, 1, 0],
    )
    out = contextual_ids(cfg=cfg, **{k: np.array(v, dtype=np.uint32) for k, v in inputs.items()})
    assert out.dtype == np.int64 and out.shape == (4, len(CONTEXTUAL_FEATURES))
    want = [py_contextual(*(inputs[k][i] for k in inputs), cfg) for i in range(4)]
    assert out.tolist() == want
    assert out[:, 0].tolist() == inputs["uid"]  # the raw uid, no modulo


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_contextual_ids_random(seed):
    rng = np.random.default_rng(seed)
    cfg = SamplerConfig(
        uid_rows=2**32, user_artist_rows=int(rng.integers(1, 10**9)), user_artist_hour_rows=7, user_organic_rows=1
    )
    n = 200
    inputs = dict(
        uid=rng.integers(0, 2**32, n, dtype=np.uint32),
        item=rng.integers(0, 2**32, n, dtype=np.uint32),
        artist=rng.integers(0, 2**32, n, dtype=np.uint32),
        album=rng.integers(0, 2**32, n, dtype=np.uint32),
        timestamp=rng.integers(0, 2**32, n, dtype=np.uint32),
        is_organic=rng.integers(0, 2, n, dtype=np.uint8),
    )
    out = contextual_ids(cfg=cfg, **inputs)
    for i in range(n):
        assert out[i].tolist() == py_contextual(*(int(inputs[k][i]) for k in inputs), cfg)
    rows = np.array(table_rows(cfg))
    assert (out >= 0).all() and (out < rows).all()
    assert (out[:, CONTEXTUAL_FEATURES.index("user_organic")] == 0).all()


def test_cross_table_matches_spec():
    assert CONTEXTUAL_FEATURES == (
        "uid",
        "user_artist",
        "user_album",
        "user_hour",
        "item_hour",
        "artist_hour",
        "user_organic",
        "user_artist_hour",
    )
    assert dict(CROSSES)["user_artist_hour"] == ("uid", "artist", "hour")
    cfg = SamplerConfig()
    assert table_rows(cfg) == (
        1_000_001,
        100_000_000,
        40_000_000,
        24_000_000,
        40_000_000,
        32_000_000,
        2_000_000,
        40_000_000,
    )


def test_uid_beyond_the_table_is_refused():
    z = np.zeros(2, dtype=np.int64)
    cfg = SamplerConfig(uid_rows=1_000)
    assert contextual_ids(np.array([0, 999]), z, z, z, z, z, cfg)[:, 0].tolist() == [0, 999]
    with pytest.raises(UserError, match=r"uid 1000 does not fit the uid table of 1,000 rows") as err:
        contextual_ids(np.array([5, 1_000]), z, z, z, z, z, cfg)
    assert "\n" not in str(err.value) and "sampler.uid_rows" in str(err.value)
    with pytest.raises(UserError, match="uid -1 "):
        contextual_ids(np.array([-1, 0]), z, z, z, z, z, cfg)


def test_empty_batch():
    z = np.zeros(0, dtype=np.int64)
    assert contextual_ids(z, z, z, z, z, z, SamplerConfig()).shape == (0, len(CONTEXTUAL_FEATURES))
    assert hash_rows(np.zeros((0, 3), dtype=np.int64), 10).shape == (0,)
