"""Contextual feature hashing: golden values and an independent big-int implementation."""

from __future__ import annotations

import numpy as np
import pytest

from dlrmv4.config import SamplerConfig
from dlrmv4.data.hashing import (CONTEXTUAL_FEATURES, CROSS_SALTS, GOLDEN_GAMMA, contextual_ids, mix64,
                                 table_rows)

MASK = 2**64 - 1


def py_mix(z: int) -> int:
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & MASK
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def py_contextual(uid: int, item: int, artist: int, album: int, ts: int, organic: int, cfg: SamplerConfig) -> list[int]:
    """The documented formula, written out with Python integers (no numpy)."""
    hour = (ts // 3600) % 24
    keys = [uid << 32 | artist, uid << 32 | album, uid << 32 | hour, item << 32 | hour, artist << 32 | hour,
            uid << 32 | organic, uid << 32 | artist << 5 | hour]
    rows = [cfg.uid_rows, cfg.user_artist_rows, cfg.user_album_rows, cfg.user_hour_rows, cfg.item_hour_rows,
            cfg.artist_hour_rows, cfg.user_organic_rows, cfg.user_artist_hour_rows]
    salts = [c * 0x9E3779B97F4A7C15 & MASK for c in range(1, 8)]
    return [uid % rows[0]] + [py_mix((k + s) & MASK) % r for k, s, r in zip(keys, salts, rows[1:])]


GOLDEN_INPUTS = dict(uid=[0, 1, 123456, 4294967295], item=[0, 7, 9390622, 4294967295],
                     artist=[0, 3, 1234567, 2**27 - 1], album=[0, 5, 7654321, 4294967295],
                     timestamp=[0, 3600, 25999999, 4294967295], is_organic=[0, 1, 1, 0])
GOLDEN_OUTPUTS = [
    [0, 58607535, 34355700, 7545679, 20542444, 26094747, 1162090, 306913],
    [1, 62640283, 23399888, 3615656, 39899324, 31153261, 627659, 14534740],
    [123456, 95677880, 33754649, 20633749, 22283819, 21535641, 1291188, 2531690],
    [967295, 62459541, 9888969, 15899245, 36759129, 7909436, 406657, 17073378],
]


def test_mix_is_splitmix64():
    # The first outputs of splitmix64 seeded with 0 (published reference values).
    states = np.array([GOLDEN_GAMMA, 2 * GOLDEN_GAMMA & MASK, 3 * GOLDEN_GAMMA & MASK], dtype=np.uint64)
    assert [int(v) for v in mix64(states)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    assert int(mix64(np.array([0], dtype=np.uint64))[0]) == 0


def test_golden_values():
    cfg = SamplerConfig()
    arrays = {k: np.array(v, dtype=np.int64) for k, v in GOLDEN_INPUTS.items()}
    out = contextual_ids(cfg=cfg, **arrays)
    assert out.dtype == np.int64 and out.shape == (4, len(CONTEXTUAL_FEATURES))
    assert out.tolist() == GOLDEN_OUTPUTS
    rows = [py_contextual(*(GOLDEN_INPUTS[k][i] for k in GOLDEN_INPUTS), cfg) for i in range(4)]
    assert rows == GOLDEN_OUTPUTS


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_big_int_reference(seed):
    rng = np.random.default_rng(seed)
    cfg = SamplerConfig(uid_rows=int(rng.integers(1, 10**6)), user_artist_rows=int(rng.integers(1, 10**9)),
                        user_artist_hour_rows=7, user_organic_rows=1)
    n = 200
    inputs = dict(uid=rng.integers(0, 2**32, n, dtype=np.uint32), item=rng.integers(0, 2**32, n, dtype=np.uint32),
                  artist=rng.integers(0, 2**27, n, dtype=np.uint32), album=rng.integers(0, 2**32, n, dtype=np.uint32),
                  timestamp=rng.integers(0, 2**32, n, dtype=np.uint32),
                  is_organic=rng.integers(0, 2, n, dtype=np.uint8))
    out = contextual_ids(cfg=cfg, **inputs)
    for i in range(n):
        assert out[i].tolist() == py_contextual(*(int(inputs[k][i]) for k in inputs), cfg)
    rows = np.array(table_rows(cfg))
    assert (out >= 0).all() and (out < rows).all()
    assert (out[:, CONTEXTUAL_FEATURES.index("user_organic")] == 0).all()


def test_salts_distinct_per_cross():
    assert len(set(CROSS_SALTS)) == len(CONTEXTUAL_FEATURES) - 1
    # The same packed key lands on different rows in different crosses.
    cfg = SamplerConfig(**{f"{n}_rows": 2**31 - 1 for n in CONTEXTUAL_FEATURES})
    zeros = np.zeros(1, dtype=np.int64)
    out = contextual_ids(zeros, zeros, zeros, zeros, zeros, zeros, cfg)[0, 1:]
    assert len(set(out.tolist())) == len(out)


def test_triple_rejects_wide_artist():
    z = np.zeros(1, dtype=np.int64)
    with pytest.raises(ValueError, match="27 bits"):
        contextual_ids(z, z, np.array([2**27]), z, z, z, SamplerConfig())


def test_empty_batch():
    z = np.zeros(0, dtype=np.int64)
    assert contextual_ids(z, z, z, z, z, z, SamplerConfig()).shape == (0, len(CONTEXTUAL_FEATURES))
