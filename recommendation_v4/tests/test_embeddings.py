"""The two embedding backends: same init, same row-wise Adagrad (FBGEMM's), exact checkpoints."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dlrmv4.config import BenchmarkConfig
from dlrmv4.data.batch import JaggedBatch
from dlrmv4.data.hashing import CONTEXTUAL_FEATURES, NUM_CONTEXTUAL
from dlrmv4.errors import UserError
from dlrmv4.model.embeddings import (
    SequenceEmbeddings,
    TableSpec,
    init_rows,
    looks_up_distinct_ids,
    make_embeddings,
    resolve_backend,
    store_table_counts,
    table_specs,
)

# The plain backend is tested everywhere; TorchRec only where it is installed.
needs_torchrec = pytest.mark.skipif(importlib.util.find_spec("torchrec") is None, reason="torchrec not installed")
TORCHREC = pytest.param("torchrec", marks=needs_torchrec)

DIM = 8
ROWS = {"item": 30, "artist": 9, "album": 17} | {name: 5 + 2 * i for i, name in enumerate(CONTEXTUAL_FEATURES)}
LR = 0.05  # large, so that the updates are far above fp32 noise


def config(backend: str, lr: float = LR, sequence_dtype: str = "float32") -> BenchmarkConfig:
    cfg = BenchmarkConfig()
    sampler = dataclasses.replace(cfg.sampler, **{f"{n}_rows": ROWS[n] for n in CONTEXTUAL_FEATURES})
    emb = dataclasses.replace(
        cfg.embeddings,
        embedding_backend=backend,
        item_rows=ROWS["item"],
        artist_rows=ROWS["artist"],
        album_rows=ROWS["album"],
    )
    return dataclasses.replace(
        cfg,
        sampler=sampler,
        embeddings=emb,
        model=dataclasses.replace(cfg.model, embedding_dim=DIM, sequence_dtype=sequence_dtype),
        train=dataclasses.replace(cfg.train, learning_rate=lr),
    )


pytestmark = pytest.mark.usefixtures("gloo_world_of_one")


def build(backend: str, seed: int = 7, lr: float = LR):
    cfg = config(backend, lr)
    return make_embeddings(table_specs(cfg, 0, 0, 0), cfg, "cpu", seed)


def batch(seed: int, lengths=(5, 0, 9, 3), dedup_ids: bool = False):
    """Small id ranges force duplicates within a feature and between history and candidate."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, np.int32)
    b, t = len(lengths), int(lengths.sum())
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = lambda table, n: rng.integers(0, min(ROWS[table], 6), n).astype(np.int64)  # noqa: E731
    contextual = np.stack([rng.integers(0, ROWS[n], b) for n in CONTEXTUAL_FEATURES], 1).astype(np.int64)
    zeros_t, zeros_b = np.zeros(t, np.int64), np.zeros(b, np.int64)
    jb = JaggedBatch(
        history_lengths=lengths,
        history_offsets=offsets,
        history_item_id=ids("item", t),
        history_artist_id=ids("artist", t),
        history_album_id=ids("album", t),
        history_action=zeros_t + 1,
        history_timestamp=zeros_t,
        contextual_ids=contextual,
        candidate_item_id=ids("item", b),
        candidate_artist_id=ids("artist", b),
        candidate_album_id=ids("album", b),
        candidate_timestamp=zeros_b,
        query_time=zeros_b,
        label=np.zeros(b, np.float32),
        anchor_index=np.arange(b, dtype=np.int64),
    )
    jb.validate()
    return jb.to_torch(dedup_ids=dedup_ids)


def loss_of(emb) -> torch.Tensor:
    """A fixed nonlinear loss, so every occurrence of a row gets its own gradient."""
    gen = torch.Generator().manual_seed(3)
    total = torch.zeros(())
    for name in SequenceEmbeddings.TENSORS:
        x = getattr(emb, name)
        total = total + (torch.tanh(x) * torch.randn(x.shape, generator=gen)).sum()
    return total


def train(module, seeds, lrs=None) -> None:
    for i, seed in enumerate(seeds):
        if lrs is not None:
            module.set_learning_rate(lrs[i])
        loss_of(module(batch(seed))).backward()
        module.sparse_step()


def tables(module) -> dict:
    return module.state_for_checkpoint()["tables"]


def assert_tables_close(a: dict, b: dict, rtol: float = 1e-6, atol: float = 1e-9) -> None:
    for name in a:
        for key in ("weight", "momentum"):
            torch.testing.assert_close(
                a[name][key], b[name][key], rtol=rtol, atol=atol, msg=lambda m, where=f"{name}.{key}": f"{where}: {m}"
            )


def test_table_specs_from_store_and_config():
    store = SimpleNamespace(artist_id=np.array([0, 4, 2], np.uint32), album_id=np.array([7, 1, 0], np.uint32))
    assert store_table_counts(store) == (3, 5, 8)
    cfg = BenchmarkConfig()
    specs = table_specs(cfg, *store_table_counts(store))
    assert [s.name for s in specs] == ["item", "artist", "album", *CONTEXTUAL_FEATURES]
    assert specs[:3] == [TableSpec("item", 3), TableSpec("artist", 5), TableSpec("album", 8)]
    assert specs[3].rows == cfg.sampler.uid_rows
    assert table_specs(config("plain"), 3, 5, 8)[0].rows == ROWS["item"]  # a set size wins
    with pytest.raises(UserError, match="'item' has 0 rows"):
        table_specs(cfg, *store_table_counts(SimpleNamespace(artist_id=np.zeros(0), album_id=np.zeros(0))))


def test_init_rows_do_not_depend_on_slicing():
    full = init_rows(2, 70_000, 0, 70_000, 2, 5, torch.device("cpu"))
    part = init_rows(2, 70_000, 65_000, 66_000, 2, 5, torch.device("cpu"))
    assert torch.equal(full[65_000:66_000], part)
    assert not torch.equal(full, init_rows(2, 70_000, 0, 70_000, 2, 6, torch.device("cpu")))


@needs_torchrec
def test_auto_picks_torchrec_when_it_runs():
    assert resolve_backend(config("auto"), torch.device("cpu")) == "torchrec"
    assert build("auto").backend == "torchrec"


@needs_torchrec
def test_same_seed_same_tables_on_both_backends():
    plain, torchrec = build("plain"), build("torchrec")
    assert (plain.backend, torchrec.backend) == ("plain", "torchrec")
    a, b = tables(plain), tables(torchrec)
    for name in a:
        assert torch.equal(a[name]["weight"], b[name]["weight"]), name
        assert torch.equal(a[name]["momentum"], torch.zeros(ROWS[name])), name
        assert torch.equal(b[name]["momentum"], torch.zeros(ROWS[name])), name
    out_p, out_t = plain(batch(0)), torchrec(batch(0))
    for name in SequenceEmbeddings.TENSORS:
        assert torch.equal(getattr(out_p, name), getattr(out_t, name)), name


def test_plain_update_is_fbgemm_rowwise_adagrad_with_duplicates_summed():
    module = build("plain")
    before = tables(module)
    b = batch(1)
    out = module(b)
    g = torch.zeros(ROWS["item"], DIM)
    # Loss = sum(history_item) + 2 * sum(candidate_item): row r's gradient is its count-weighted sum.
    t = b.total_tokens
    (out.item[:t].sum() + 2 * out.item[t:].sum()).backward()
    g.index_add_(0, b.history_item_id, torch.ones(b.total_tokens, DIM))
    g.index_add_(0, b.candidate_item_id, 2 * torch.ones(b.num_samples, DIM))
    module.sparse_step()
    after = tables(module)["item"]
    state = (g * g).sum(1) / DIM
    expected = before["item"]["weight"] - (torch.tensor(LR) / (state.sqrt() + 1e-8))[:, None] * g
    torch.testing.assert_close(after["momentum"], state, rtol=0, atol=0)
    torch.testing.assert_close(after["weight"], expected, rtol=1e-6, atol=1e-9)


@needs_torchrec
def test_training_matches_across_backends_and_spares_untouched_rows():
    plain, torchrec = build("plain"), build("torchrec")
    init = tables(plain)
    seeds, lrs = [11, 12, 13, 14], [0.01, 0.02, 0.03, 0.05]  # a warm-up: the lr changes every step
    train(plain, seeds, lrs)
    train(torchrec, seeds, lrs)
    a, b = tables(plain), tables(torchrec)
    # The backends sum a row's duplicate gradients in different orders: a few fp32 ulps of an update
    # of up to lr * 1 = 0.05 (Adagrad's first step moves a row by about lr).
    assert_tables_close(a, b, atol=1e-7)
    for name in a:
        touched = a[name]["momentum"] > 0
        assert touched.any(), name
        assert torch.equal(a[name]["weight"][~touched], init[name]["weight"][~touched]), name
        assert torch.equal(b[name]["weight"][~touched], init[name]["weight"][~touched]), name
        assert not torch.equal(a[name]["weight"][touched], init[name]["weight"][touched]), name
    out_p, out_t = plain(batch(99)), torchrec(batch(99))
    for name in SequenceEmbeddings.TENSORS:
        torch.testing.assert_close(getattr(out_p, name), getattr(out_t, name), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", ["plain", TORCHREC])
def test_set_learning_rate_takes_effect(backend):
    module = build(backend)
    init = tables(module)
    module.set_learning_rate(0.0)
    train(module, [21])
    frozen = tables(module)
    for name in init:
        assert torch.equal(frozen[name]["weight"], init[name]["weight"]), name
    assert (frozen["item"]["momentum"] > 0).any()  # the state still accumulates
    module.set_learning_rate(LR)
    train(module, [22])
    assert not torch.equal(tables(module)["item"]["weight"], init["item"]["weight"])


@pytest.mark.parametrize(
    "source,target",
    [
        ("plain", "plain"),
        pytest.param("torchrec", "torchrec", marks=needs_torchrec),
        pytest.param("plain", "torchrec", marks=needs_torchrec),
    ],
)
def test_checkpoint_round_trip_and_resume(source, target):
    reference = build(source)
    train(reference, [31, 32])
    saved = reference.state_for_checkpoint()
    snapshot = copy.deepcopy(saved["tables"])
    lookup = reference(batch(40))
    train(reference, [33, 34])  # the uninterrupted run

    resumed = build(target, seed=8)  # another init: everything must come from the checkpoint
    train(resumed, [35])  # perturb weights and states
    resumed.load_from_checkpoint(saved)
    assert_tables_close(tables(resumed), saved["tables"], rtol=0)
    after_load = resumed(batch(40))
    for name in SequenceEmbeddings.TENSORS:
        assert torch.equal(getattr(lookup, name), getattr(after_load, name)), name
    train(resumed, [33, 34])
    # Across backends a row's duplicate gradients add up in another order: a few fp32 ulps.
    assert_tables_close(tables(resumed), tables(reference), rtol=0 if source == target else 1e-6, atol=1e-8)
    assert_tables_close(saved["tables"], snapshot, rtol=0)  # a copy, not a view of live tables


def test_checkpoint_of_another_shape_is_refused():
    module = build("plain")
    state = module.state_for_checkpoint()
    state["tables"]["album"]["momentum"] = torch.zeros(3)
    with pytest.raises(UserError, match="'album'"):
        module.load_from_checkpoint(state)


def test_check_ids_names_the_feature():
    module = build("plain")
    good = batch(50)
    module.check_ids(good)
    bad = dataclasses.replace(good, candidate_album_id=good.candidate_album_id + ROWS["album"])
    with pytest.raises(ValueError, match="candidate_album_id.*'album' has 17 rows"):
        module.check_ids(bad)
    ctx = good.contextual_ids.clone()
    ctx[0, NUM_CONTEXTUAL - 1] = -1
    with pytest.raises(ValueError, match="user_artist_hour"):
        module.check_ids(dataclasses.replace(good, contextual_ids=ctx))


def test_plain_update_with_zero_eps_leaves_untouched_rows_finite():
    cfg = config("plain")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, adagrad_eps=0.0))
    module = make_embeddings(table_specs(cfg, 0, 0, 0), cfg, "cpu", 7)
    b = batch(90)
    b = dataclasses.replace(b, history_item_id=b.history_item_id + 1, candidate_item_id=b.candidate_item_id + 1)
    loss_of(module(b)).backward()
    module.sparse_step()
    item = tables(module)["item"]
    assert item["momentum"][0] == 0 and torch.isfinite(item["weight"]).all()


def test_plain_backend_accumulates_several_backwards_into_one_step():
    """Two backwards before one sparse_step act as one batch: gradients add before the update."""
    once, twice = build("plain"), build("plain")
    b = batch(60)
    (2 * loss_of(once(b))).backward()
    once.sparse_step()
    loss_of(twice(b)).backward()
    loss_of(twice(b)).backward()
    twice.sparse_step()
    assert_tables_close(tables(once), tables(twice), atol=1e-8)  # 2g against g + g: a few fp32 ulps


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_plain_step_on_gpu_has_no_host_sync_and_matches_cpu():
    cfg = config("plain")
    gpu, cpu = (make_embeddings(table_specs(cfg, 0, 0, 0), cfg, device, 7) for device in ("cuda", "cpu"))
    gpu.load_from_checkpoint(cpu.state_for_checkpoint())  # CUDA and CPU generators draw different inits
    batches = [batch(seed) for seed in (80, 81, 82)]
    on_gpu = [b.to("cuda") for b in batches]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step, b in enumerate(on_gpu):
            gpu.set_learning_rate(0.01 * (step + 1))
            sum(torch.tanh(getattr(gpu(b), n)).sum() for n in SequenceEmbeddings.TENSORS).backward()
            gpu.sparse_step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for step, b in enumerate(batches):
        cpu.set_learning_rate(0.01 * (step + 1))
        sum(torch.tanh(getattr(cpu(b), n)).sum() for n in SequenceEmbeddings.TENSORS).backward()
        cpu.sparse_step()
    # CUDA's tanh differs from the CPU's in the last bits: the tolerance is relative to weights ~0.1.
    assert_tables_close(tables(gpu), tables(cpu), rtol=1e-5, atol=1e-7)


def test_plain_sequence_rows_in_the_sequence_dtype():
    """With a bf16 sequence model the plain backend looks the sequence rows up in bf16 (the values
    the model's first layers would cast them to) and the candidate's item-tower rows in fp32; the
    update from those gradients is the fp32 one."""
    fp32, bf16 = (
        make_embeddings(
            table_specs(config("plain", sequence_dtype=d), 0, 0, 0), config("plain", sequence_dtype=d), "cpu", 7
        )
        for d in ("float32", "bfloat16")
    )
    b = batch(70)
    out32, out16 = fp32(b), bf16(b)
    for name in ("item", "artist", "album", "contextual"):
        assert getattr(out16, name).dtype == torch.bfloat16, name
        assert torch.equal(getattr(out16, name), getattr(out32, name).to(torch.bfloat16)), name
    assert out16.candidate.dtype == torch.float32 and torch.equal(out16.candidate, out32.candidate)
    gen = torch.Generator().manual_seed(5)
    # bf16-exact weights: both gradients are exactly these numbers, in either dtype.
    weights = {
        n: torch.randn(getattr(out32, n).shape, generator=gen).to(torch.bfloat16) for n in SequenceEmbeddings.TENSORS
    }
    for out in (out32, out16):
        sum((getattr(out, n).float() * w.float()).sum() for n, w in weights.items()).backward()
    fp32.sparse_step()
    bf16.sparse_step()
    assert_tables_close(tables(fp32), tables(bf16), rtol=0, atol=0)
    assert not torch.equal(tables(bf16)["item"]["weight"], tables(build("plain"))["item"]["weight"])


@needs_torchrec
def test_ids_distributed_ahead_give_the_same_lookup_and_update():
    """The sparse-dist pipeline: batch 2's ids start their distribution before batch 1 is looked up
    and trained; a lookup of another batch in between (an eval's) leaves them waiting; batch 2's
    lookup then takes them. Rows, gradients' updates and tables equal the unpipelined module's."""
    ahead, plain_order = build("torchrec"), build("torchrec")
    batches = [batch(seed) for seed in (11, 12, 13)]
    ahead.distribute_ids(batches[1])
    for module in (ahead, plain_order):
        loss_of(module(batches[0])).backward()
    ahead.settle_ids()
    with torch.no_grad():
        other = [module(batches[2]) for module in (ahead, plain_order)]  # not the batch on its way
    assert len(ahead._distributed) == 1 and ahead._distributed[0].batch is batches[1]
    got, want = ahead(batches[1]), plain_order(batches[1])
    assert ahead._distributed == []  # taken by its own lookup
    for a, b in zip(got.tensors() + other[0].tensors(), want.tensors() + other[1].tensors()):
        assert torch.equal(a, b)
    for module, emb in ((ahead, got), (plain_order, want)):
        loss_of(emb).backward()
    assert_tables_close(tables(ahead), tables(plain_order), rtol=0, atol=0)


@needs_torchrec
def test_an_evals_own_pipeline_between_two_steps_leaves_the_steps_ids_waiting():
    """A step sends batch 1's ids ahead; an eval then runs between the two steps with a pipeline of
    its own (each of batches 2-4 sends the next one's ids ahead, under no_grad); batch 1's lookup
    still takes the ids sent before the eval. Every lookup and the update equal the unpipelined
    module's."""
    ahead, plain_order = build("torchrec"), build("torchrec")
    batches = [batch(seed) for seed in (11, 12, 13, 14, 15)]
    ahead.distribute_ids(batches[1])
    for module in (ahead, plain_order):
        loss_of(module(batches[0])).backward()
    ahead.settle_ids()
    got, want = [], []
    with torch.no_grad():
        for i in (2, 3, 4):
            got.append(ahead(batches[i]))
            if i < 4:
                ahead.distribute_ids(batches[i + 1])
            want.append(plain_order(batches[i]))
            ahead.settle_ids()
    assert ahead.lookups_distributed_ahead == 2  # batches 3 and 4
    assert len(ahead._distributed) == 1 and ahead._distributed[0].batch is batches[1]
    step_got, step_want = ahead(batches[1]), plain_order(batches[1])
    assert ahead.lookups_distributed_ahead == 3 and ahead._distributed == []
    for a, b in zip(
        [t for e in got + [step_got] for t in e.tensors()], [t for e in want + [step_want] for t in e.tensors()]
    ):
        assert torch.equal(a, b)
    for module, emb in ((ahead, step_got), (plain_order, step_want)):
        loss_of(emb).backward()
    assert_tables_close(tables(ahead), tables(plain_order), rtol=0, atol=0)


@needs_torchrec
def test_deduplicated_ids_give_the_same_rows_and_update():
    """embeddings.dedup_ids: the lookup asks for each distinct history id once (fewer ids, also when
    sent ahead) and every token gets its row back; the rows equal the full lookup's, and the update
    (a row's token gradients summed before the lookup's backward) equals it to fp32 rounding."""
    full, dedup = build("torchrec"), build("torchrec")
    seeds, lrs = [11, 12, 13, 14], [0.01, 0.02, 0.03, 0.05]
    for i, seed in enumerate(seeds):
        for module in (full, dedup):
            module.set_learning_rate(lrs[i])
        b_full, b_dedup = batch(seed), batch(seed, dedup_ids=True)
        assert b_dedup.unique_counts is not None and sum(b_dedup.unique_counts) < 3 * b_dedup.total_tokens
        if i % 2:  # the pipeline's path: the distinct ids sent ahead
            dedup.distribute_ids(b_dedup)
        got, want = dedup(b_dedup), full(b_full)
        for a, b in zip(got.tensors(), want.tensors()):
            assert torch.equal(a, b)
        for module, emb in ((full, want), (dedup, got)):
            loss_of(emb).backward()
            module.sparse_step()
    assert dedup.lookups_distributed_ahead == 2
    assert dedup.ids_looked_up < full.ids_looked_up
    assert_tables_close(tables(dedup), tables(full), atol=1e-7)


@needs_torchrec
def test_the_distinct_rows_gather_follows_the_models_kernels(monkeypatch):
    """The gather that spreads a deduplicated batch's rows to its tokens takes ``model.kernels``:
    its backward is the Triton segment sum with "triton" (interpreted here), autograd's with
    "pytorch"; the updates agree."""
    from dlrmv4.ops.triton import gather_rows as tri

    calls = []
    real = tri.segment_sum
    monkeypatch.setattr(tri, "segment_sum", lambda *a: calls.append(1) or real(*a))
    updated = {}
    for kernels in ("triton", "pytorch"):
        cfg = config("torchrec")
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, kernels=kernels))
        module = make_embeddings(table_specs(cfg, 0, 0, 0), cfg, "cpu", 7)
        calls.clear()
        loss_of(module(batch(21, dedup_ids=True))).backward()
        module.sparse_step()
        assert bool(calls) == (kernels == "triton"), (kernels, len(calls))
        updated[kernels] = tables(module)
    assert_tables_close(updated["triton"], updated["pytorch"], atol=1e-6)


def test_deduplicated_ids_are_for_torchrec_only():
    """On by default; the plain backend, which exchanges no rows, takes every token's id."""
    cfg = config("plain")
    assert cfg.embeddings.dedup_ids
    assert looks_up_distinct_ids(cfg, "torchrec") and not looks_up_distinct_ids(cfg, "plain")
    assert make_embeddings(table_specs(cfg, 0, 0, 0), cfg, "cpu", 7).backend == "plain"


@needs_torchrec
def test_distributed_model_parallel_wraps_the_whole_model():
    """TorchRec backend: one DistributedModelParallel holds the sharded tables and the dense model
    (data parallel through it: the model itself on one rank); the dense parameters stay out of the
    tables' module, whose parameters belong to the sparse optimizer."""
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.model_parallel import DistributedModelParallel, get_unwrapped_module

    from dlrmv4.model.hstu import DlrmHSTU

    cfg = config("torchrec")
    model = DlrmHSTU(cfg.model, seed=0)
    module = make_embeddings(table_specs(cfg, 0, 0, 0), cfg, "cpu", 7, dense=model)
    assert isinstance(module.dmp, DistributedModelParallel)
    wrapped = get_unwrapped_module(module.dmp)
    assert isinstance(wrapped.tables, ShardedEmbeddingCollection) and wrapped.dense is model
    assert module.dense_parallel is model  # one rank: nothing to average
    assert module.tables is wrapped.tables
    dense_ids = {id(p) for p in model.parameters()}
    table_ids = {id(p) for p in module.parameters()}
    assert table_ids and not dense_ids & table_ids


@needs_torchrec
def test_tables_in_host_memory_are_reported_from_the_plan():
    """The trainer starts loader workers from a fork server where this rank holds tables in pinned
    host memory (TorchRec's uvm kernels): read from the sharding plan."""
    module = build("torchrec")
    assert not module.holds_pinned_host_memory  # the CPU plan: every table "fused"
    plan = copy.deepcopy(module.plan)
    sharding = next(iter(plan.plan.values()))
    sharding["user_artist"] = dataclasses.replace(sharding["user_artist"], compute_kernel="fused_uvm")
    module.plan = plan
    assert module.holds_pinned_host_memory
