"""The streaming window loader: order, resume, shuffle, worker sharding, no padding."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from store_factory import random_store

from dlrmv4.config import BenchmarkConfig, LoaderConfig, SamplerConfig
from dlrmv4.data.batch import BATCH_DTYPES, ID_FIELDS, TorchJaggedBatch
from dlrmv4.data.loader import (
    BatchSlice,
    WindowDataset,
    balanced_shares,
    make_window_loader,
    plan_batches,
    rank_share,
    share_size,
)
from dlrmv4.data.sampler import build_batch, history_lengths
from dlrmv4.data.sparse_features import SPARSE_KEYS
from dlrmv4.data.store import open_store

BATCH = 7


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("loader") / "store"
    return open_store(random_store(path, seed=11, lengths=[40, 90, 0, 130, 25], min_history=5, num_windows=4))


def config(workers: int = 0, shuffle: bool = False, seed: int = 0, order: str = "index") -> BenchmarkConfig:
    return BenchmarkConfig(
        seed=seed,
        sampler=SamplerConfig(max_seq_len=39, scan_window=60),
        loader=LoaderConfig(batch_size=BATCH, num_workers=workers, shuffle_within_window=shuffle, window_order=order),
    )


def anchors_of(loader) -> list[list[int]]:
    return [b.anchor_index.tolist() for b in loader]


def test_windows_are_nonempty_and_uneven(store):
    sizes = np.diff(store.window_offsets)
    assert (sizes > 2 * BATCH).all() and (sizes % BATCH != 0).any()


@pytest.mark.parametrize("drop_last", [False, True])
def test_time_order_same_for_0_1_2_workers(store, drop_last):
    windows = [2, 0, 1]
    expected = []
    for w in windows:
        anchors = np.asarray(store.window_anchors(w)).tolist()
        cut = len(anchors) - len(anchors) % BATCH if drop_last else len(anchors)
        expected += [anchors[s : min(s + BATCH, cut)] for s in range(0, cut, BATCH)]
    for workers in (0, 1, 2):
        loader = make_window_loader(store, windows, config(workers), drop_last=drop_last)
        assert len(loader) == len(expected)
        assert anchors_of(loader) == expected, workers
    for w in windows:  # within a window, anchors stream in ascending event index (user-major)
        got = [a for b in make_window_loader(store, [w], config()) for a in b.anchor_index.tolist()]
        assert np.all(np.diff(got) > 0)


def test_time_order_is_a_switch(store):
    ts = np.asarray(store.train.timestamp)
    for w in range(store.num_windows):
        got = [a for b in make_window_loader(store, [w], config(order="time")) for a in b.anchor_index.tolist()]
        assert sorted(got) == np.asarray(store.window_anchors(w)).tolist()
        assert all((ts[a], a) <= (ts[b], b) for a, b in zip(got, got[1:]))  # time order, ties by index


@pytest.mark.parametrize("slicing", ["strided", "contiguous", "balanced"])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_rank_shares_split_a_batch(slicing, world):
    part = BatchSlice(window=0, start=5, stop=5 + 13)
    tokens = np.random.default_rng(world).integers(0, 100, 13)
    shares = [rank_share(part, r, world, slicing, tokens).tolist() for r in range(world)]
    assert sorted(x for share in shares for x in share) == list(range(5, 18))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert [len(share) for share in shares] == [share_size(13, r, world, slicing) for r in range(world)]
    if slicing == "balanced":
        assert all(share == sorted(share) for share in shares)
        if world == 1:  # one rank takes the batch whole: no lengths needed
            assert rank_share(part, 0, 1, slicing).tolist() == list(range(5, 18))
        else:
            with pytest.raises(ValueError, match="token count"):
                rank_share(part, 0, world, slicing)
        return
    if slicing == "strided":  # the reference's: rank r takes samples r, r + W, r + 2W, ...
        assert shares[0][:2] == [5, 5 + world] if world < 13 else shares[0] == [5]
        assert all(share == list(range(5 + r, 18, world)) for r, share in enumerate(shares))
    else:
        assert all(share == sorted(share) and (not share or share[-1] - share[0] == len(share) - 1) for share in shares)
    with pytest.raises(ValueError, match="slicing"):
        rank_share(part, 0, world, "round")


@pytest.mark.parametrize("world", [2, 3, 8])
def test_balanced_shares_even_out_the_tokens(world):
    """Skewed lengths (a few long histories among short ones): the token sums of the balanced
    shares differ by at most the longest sample, and by far less than the strided shares' do."""
    rng = np.random.default_rng(world)
    spread = {"balanced": [], "strided": []}
    for _ in range(20):
        tokens = np.minimum(rng.pareto(1.0, 256) * 50, 4_000).astype(np.int64) + 9
        balanced = balanced_shares(tokens, world)
        assert [s.tolist() for s in balanced] == [s.tolist() for s in balanced_shares(tokens.copy(), world)]
        sums = [int(tokens[s].sum()) for s in balanced]
        assert max(sums) - min(sums) <= tokens.max()
        spread["balanced"].append(max(sums) - min(sums))
        strided = [int(tokens[r::world].sum()) for r in range(world)]
        spread["strided"].append(max(strided) - min(strided))
    assert np.mean(spread["balanced"]) * 5 < np.mean(spread["strided"])


def test_balanced_loader_shares_partition_every_batch(store):
    """Each rank's loader builds its balanced share of every global batch: together the ranks see
    the global batch once, with token sums as balanced as ``balanced_shares`` makes them."""
    cfg = dataclasses.replace(
        config(workers=2), loader=LoaderConfig(batch_size=BATCH, num_workers=2, rank_slicing="balanced")
    )
    world = 2
    whole = anchors_of(make_window_loader(store, [1, 3], config()))
    per_rank = [list(make_window_loader(store, [1, 3], cfg, rank=r, world_size=world)) for r in range(world)]
    for i, anchors in enumerate(whole):
        tokens = history_lengths(store, np.asarray(anchors), cfg.sampler)
        want = balanced_shares(tokens, world)
        for r in range(world):
            assert per_rank[r][i].anchor_index.tolist() == np.asarray(anchors)[want[r]].tolist()


def test_batches_equal_the_sampler_and_are_not_padded(store):
    cfg = config(workers=2)
    order = np.asarray(store.window_anchors(1))
    lengths = []
    for i, tb in enumerate(make_window_loader(store, [1], cfg)):
        assert isinstance(tb, TorchJaggedBatch)
        host = build_batch(store, order[i * BATCH : (i + 1) * BATCH], cfg.sampler)
        for name in BATCH_DTYPES:
            assert np.array_equal(getattr(tb, name).numpy(), getattr(host, name)), name
        assert tb.history_item_id.shape == (int(tb.history_lengths.sum()),) == (tb.total_tokens,)
        assert tb.max_history_length == int(tb.history_lengths.max())
        # One packed buffer crossed the process boundary: every field views the same storage.
        assert len({getattr(tb, name).untyped_storage().data_ptr() for name in BATCH_DTYPES}) == 1
        lengths += tb.history_lengths.tolist()
    assert len(set(lengths)) > 1 and min(lengths) < cfg.sampler.history_length


@pytest.mark.parametrize("workers", [0, 2])
def test_start_batch_skips_exactly(store, workers):
    full = anchors_of(make_window_loader(store, [0, 3], config()))
    for start in (0, 1, 2, len(full) - 1, len(full)):
        loader = make_window_loader(store, [0, 3], config(workers), start_batch=start)
        assert len(loader) == len(full) - start
        assert anchors_of(loader) == full[start:]
    with pytest.raises(ValueError, match="start_batch"):
        make_window_loader(store, [0, 3], config(), start_batch=len(full) + 1)


def test_shuffle_is_seeded_per_window(store):
    def stream(seed: int, workers: int = 0) -> list[list[int]]:
        return anchors_of(make_window_loader(store, [1, 2], config(workers, shuffle=True, seed=seed)))

    a = stream(5)
    assert a == stream(5, workers=2) == stream(5)
    assert a != stream(6)
    plain = anchors_of(make_window_loader(store, [1, 2], config()))
    assert a != plain
    # Still a permutation inside each window, and batches never mix windows.
    n1 = len(store.window_anchors(1))
    flat = [x for b in a for x in b]
    assert sorted(flat[:n1]) == sorted(np.asarray(store.window_anchors(1)).tolist())
    assert sorted(flat[n1:]) == sorted(np.asarray(store.window_anchors(2)).tolist())
    # The permutation of a window does not depend on which other windows are streamed.
    alone = [x for b in anchors_of(make_window_loader(store, [2], config(shuffle=True, seed=5))) for x in b]
    assert alone == flat[n1:]


def test_plan_and_errors(store):
    assert plan_batches([(3, 10), (1, 0), (0, 7)], 4, drop_last=False) == [
        (3, 0, 4),
        (3, 4, 8),
        (3, 8, 10),
        (0, 0, 4),
        (0, 4, 7),
    ]
    assert plan_batches([(3, 10), (0, 7)], 4, drop_last=True) == [(3, 0, 4), (3, 4, 8), (0, 0, 4)]
    with pytest.raises(ValueError, match="windows"):
        WindowDataset(store, [store.num_windows], SamplerConfig(), batch_size=4)
    cfg = dataclasses.replace(config(workers=2), loader=LoaderConfig(batch_size=10_000, num_workers=2))
    assert [len(b) for b in anchors_of(make_window_loader(store, [0], cfg))] == [len(store.window_anchors(0))]


def test_packed_batch_moves_as_one_buffer(store):
    host = build_batch(store, np.asarray(store.window_anchors(0))[:BATCH], config().sampler)
    tb = host.to_torch()
    packed = tb._packed()
    # The ids in one region, the KeyedJaggedTensor's lengths (one per sample and feature) in another,
    # every other field in its own; each region padded to 16 bytes.
    lengths_bytes = len(SPARSE_KEYS) * host.num_samples * 8
    id_bytes = sum(getattr(host, n).nbytes for n in ID_FIELDS)
    others = [n for n in BATCH_DTYPES if n not in ID_FIELDS]
    expected = sum(
        -(-nbytes // 16) * 16 for nbytes in [id_bytes, lengths_bytes] + [getattr(host, n).nbytes for n in others]
    )
    assert packed is not None and packed.numel() == expected
    moved = tb._on(packed.clone())  # what pin_memory() and to(device) do with their one copy
    for name in BATCH_DTYPES:
        got = getattr(moved, name)
        assert got.dtype == getattr(tb, name).dtype and np.array_equal(got.numpy(), getattr(host, name)), name
    assert moved.id_lengths is not None and moved.id_lengths.untyped_storage().data_ptr() == moved._packed().data_ptr()
    assert moved.history_item_id.untyped_storage().data_ptr() != tb.history_item_id.untyped_storage().data_ptr()
    # A batch whose fields do not share one buffer moves field by field.
    loose = dataclasses.replace(tb, label=tb.label.clone())
    assert loose._packed() is None and np.array_equal(loose.to("cpu").label.numpy(), host.label)


@pytest.mark.parametrize("lengths", [[3, 2, 4], [3, 1, 4], [1]])
def test_every_region_of_a_packed_batch_starts_16_byte_aligned(lengths):
    """Triton specializes kernels on 16-byte pointer alignment: a field's alignment must not follow
    the token count before it (odd counts of 1-byte actions or 8-byte ids shifted the fields after)."""
    from model_inputs import random_batch

    tb = random_batch(lengths, seed=0)
    base = tb._packed().data_ptr()
    for name in [n for n in BATCH_DTYPES if n not in ID_FIELDS] + ["id_lengths"]:
        assert (getattr(tb, name).data_ptr() - base) % 16 == 0, name


def test_device_prefetcher_passes_batches_through_on_the_cpu():
    from model_inputs import random_batch

    from dlrmv4.train.prefetch import DevicePrefetcher

    host = [random_batch([3, 1, 4], seed=i) for i in range(3)]
    out = list(DevicePrefetcher(host, torch.device("cpu")))
    assert len(out) == 3 and all(torch.equal(a.history_item_id, b.history_item_id) for a, b in zip(host, out))


def test_workers_started_by_a_fork_server_give_the_same_batches(store):
    """A rank whose tables live in pinned host memory starts its loader workers from a fork server
    (a forked worker would copy every pinned page): the dataset pickles into them and yields the
    same batches, in the same order."""
    windows = list(range(store.num_windows))
    forked = make_window_loader(store, windows, config(workers=2))
    served = make_window_loader(store, windows, config(workers=2), worker_start="forkserver")
    assert served.multiprocessing_context.get_start_method() == "forkserver"
    assert anchors_of(served) == anchors_of(forked)


def test_persistent_workers_serve_every_iteration_without_restarting(store):
    """The holdout loader is iterated at every eval: its workers stay, and every pass gives the
    same batches as a fresh loader."""
    windows = [store.num_windows - 1]
    loader = make_window_loader(store, windows, config(workers=2), persistent_workers=True)
    first = anchors_of(loader)
    workers = [w.pid for w in loader._iterator._workers]
    assert anchors_of(loader) == first == anchors_of(make_window_loader(store, windows, config(workers=2)))
    assert [w.pid for w in loader._iterator._workers] == workers and all(
        w.is_alive() for w in loader._iterator._workers
    )


@pytest.mark.parametrize("workers", [0, 1])
def test_an_item_id_beyond_the_stores_items_is_one_line_naming_the_store(tmp_path, workers):
    """A damaged item column (an id past the item tables) stops the loader with one line naming the
    store and verify, in a worker process too, not with the embedding lookup's IndexError."""
    from dlrmv4.errors import UserError

    path = random_store(tmp_path / "store", seed=11, lengths=[40, 90, 130], min_history=5, num_windows=4)
    items = np.load(path / "train" / "item_id.npy", mmap_mode="r+")
    items[:] = len(np.load(path / "items" / "artist_id.npy")) + 7  # every event: whichever batch comes first
    items.flush()
    del items
    loader = make_window_loader(open_store(path), [0, 1, 2], config(workers))
    with pytest.raises(UserError) as info:
        list(loader)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}: item id ")
    assert f"python -m dlrmv4 verify --store {path}" in message


@pytest.mark.parametrize("scenario, code", [("killed", 1), ("damaged", 1), ("done", 0)])
def test_a_rank_ending_with_its_workers_alive_leaves_no_semaphore_and_no_worker(tmp_path, scenario, code):
    """A process holding loaders whose workers a fork server started (a rank whose tables are in pinned
    host memory: the holdout's persistent workers and the training loader's) ends as a rank of
    several does, with ``os._exit``: after a training worker was SIGKILLed mid-stream, after a
    worker's error in the first batch, and after the training loader's last batch. It ends with the
    project's line alone (no resource tracker's 'leaked semaphore objects' warning once it has gone),
    and its workers, fork server and resource tracker end with it (the pipes close)."""
    tests = Path(__file__).parent
    env = dict(os.environ, RANK="1", WORLD_SIZE="2")  # a rank of several, not the store's host: os._exit
    env["PYTHONPATH"] = os.pathsep.join([str(tests), str(tests.parent / "benchmarks"), str(tests.parent)])
    env.pop("PYTHONWARNINGS", None)  # the resource tracker's complaint is a warning
    proc = subprocess.Popen(
        [sys.executable, str(tests / "loader_exit_worker.py"), scenario, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its workers, fork server and tracker share its process group
    )
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{scenario}: the process or a loader worker of it still runs after 60 s")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == code, err[-3000:]
    lines = err.splitlines()
    if code:
        assert len(lines) == 1 and lines[0].startswith("[dlrmv4] error: "), err[-3000:]
    else:
        assert lines == [] and out == f"{scenario}: loader done\n", err[-3000:]
