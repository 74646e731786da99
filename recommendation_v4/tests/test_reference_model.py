"""The reference model's choices, pinned with values worked out by hand from its formulas
(docs/model.md names each source): the tables' and the encoders' initial distributions, the layer
norms' eps, the contextual tokens' time buckets, the postprocessor's time features and the
timestamp it reads, the precision of the modules and of the embedding all-to-all, the dense Adam's
step count and the dropout stream across ranks."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from model_inputs import random_batch, random_embeddings
from step_setup import small_table_config
from test_model import SMALL

from dlrmv4.config import ModelConfig
from dlrmv4.config_loading import load_config
from dlrmv4.distributed.cluster import Cluster
from dlrmv4.model.embeddings import init_rows, make_embeddings, table_specs
from dlrmv4.model.embeddings.wire import through_wire
from dlrmv4.model.heads import time_features
from dlrmv4.model.hstu import DlrmHSTU
from dlrmv4.model.layers import LayerNorm
from dlrmv4.ops.jagged import concat_sequence_timestamps
from dlrmv4.ops.reference.position import positions_and_buckets

# Yambda-5B's tables and the half-width sqrt(1 / rows) of their uniform init (the reference's
# TorchRec default; the "about 1.9e-4" is the item table's standard deviation b / sqrt(3)).
YAMBDA_TABLES = {
    "item": (9_390_624, 3.2633e-4),
    "artist": (1_293_395, 8.7930e-4),
    "album": (3_367_692, 5.4493e-4),
    "uid": (1_000_001, 9.9999e-4),
    "user_artist": (100_000_000, 1.0000e-4),
    "user_album": (40_000_000, 1.5811e-4),
    "user_hour": (24_000_000, 2.0412e-4),
    "item_hour": (40_000_000, 1.5811e-4),
    "artist_hour": (32_000_000, 1.7678e-4),
    "user_organic": (2_000_000, 7.0711e-4),
    "user_artist_hour": (40_000_000, 1.5811e-4),
}


def test_the_yambda_tables_start_uniform_within_sqrt_one_over_rows():
    from dlrmv4.model.embeddings.tables import init_bound
    from dlrmv4.reference_counts import YAMBDA_5B_TABLE_COUNTS

    cfg = load_config("yambda-5b")
    specs = {s.name: s.rows for s in table_specs(cfg, *YAMBDA_5B_TABLE_COUNTS)}
    assert {name: rows for name, (rows, _) in YAMBDA_TABLES.items()} == specs
    for name, (rows, bound) in YAMBDA_TABLES.items():
        assert init_bound(rows) == pytest.approx(bound, rel=1e-4), name
    assert init_bound(9_390_624) / math.sqrt(3) == pytest.approx(1.884e-4, rel=1e-3)


@pytest.mark.parametrize("rows", [7, 1_000, 200_000])
def test_table_rows_are_uniform_with_the_reference_bound(rows):
    values = init_rows(0, rows, 0, rows, 16, 5, torch.device("cpu"))
    bound = math.sqrt(1.0 / rows)
    assert float(values.abs().max()) <= bound
    if rows >= 1_000:  # enough draws for the moments of uniform(-b, b)
        assert float(values.std()) == pytest.approx(bound / math.sqrt(3), rel=0.02)
        assert float(values.abs().max()) > 0.99 * bound


@torch.no_grad()  # the parameters' statistics, without autograd
def test_the_position_and_time_tables():
    cfg = load_config("yambda-5b").model
    model = DlrmHSTU(dataclasses.replace(cfg, num_layers=1), seed=0)
    pos, time = model.preprocessor.position_table, model.preprocessor.time_table
    assert pos.shape == (8_192, 512) and time.shape == (2_049, 512)  # buckets 0 .. 2,048
    # sqrt(1 / 8,192) = 0.01105 and sqrt(1 / 2,048) = 0.02210: the time table's bound is taken from
    # its largest bucket, not its row count (the reference's).
    for table, bound in ((pos, math.sqrt(1 / 8_192)), (time, math.sqrt(1 / 2_048))):
        assert float(table.abs().max()) <= bound and float(table.abs().max()) > 0.99 * bound
        assert float(table.std()) == pytest.approx(bound / math.sqrt(3), rel=0.01)


def _beyond_uniform(w: torch.Tensor) -> float:
    """The share of weights beyond Xavier-uniform's bound sqrt(6 / (fan_in + fan_out)): 0 for the
    uniform draw, about 8.3 % for the normal draw of the same variance."""
    fan_out, fan_in = w.shape
    return float((w.abs() > math.sqrt(6.0 / (fan_in + fan_out))).float().mean())


@torch.no_grad()  # the parameters' statistics, without autograd
def test_dense_initialisations():
    cfg = dataclasses.replace(load_config("yambda-5b").model, num_layers=1)
    model = DlrmHSTU(cfg, seed=0)
    pre = model.preprocessor
    normal = [pre.content[0], pre.content[2], pre.extra_ids[0], pre.extra_ids[2], pre.action[0], pre.action[2]]
    normal.append(model.postprocessor.linear)
    for linear in normal:  # Xavier-normal: the reference re-draws its sequence model's Linears
        assert 0.07 < _beyond_uniform(linear.weight) < 0.10
        assert float(linear.weight.std()) == pytest.approx(math.sqrt(2.0 / sum(linear.weight.shape)), rel=0.05)
        assert torch.equal(linear.bias, torch.zeros_like(linear.bias))
    for linear in (model.item_tower[0], model.item_tower[2], model.head[0], model.head[2]):
        assert _beyond_uniform(linear.weight) == 0.0  # Xavier-uniform
    for proj in pre.contextual:  # N(0, 2 / (E + D)), zero bias
        assert float(proj.weight.std()) == pytest.approx(math.sqrt(2.0 / (512 + 512)), rel=0.02)
        assert 0.07 < _beyond_uniform(proj.weight) < 0.10
        assert torch.equal(proj.bias, torch.zeros_like(proj.bias))


def test_layer_norm_eps_is_the_references_for_every_norm():
    model = DlrmHSTU(SMALL, seed=0)
    stu_norms = {f"stu.layers.{i}.input_norm" for i in range(SMALL.num_layers)}
    eps = {name: m.eps for name, m in model.named_modules() if isinstance(m, LayerNorm)}
    assert eps and {name for name in eps if name.startswith("stu.")} == stu_norms
    for name, value in eps.items():
        assert value == (1e-6 if name in stu_norms else 1e-5), name
    assert SMALL.layer_norm_eps == 1e-6  # also the STU's attention norm (ops/stu_layer.py)
    tower_norms = {n.rsplit(".", 1)[0] for n in eps if not n.startswith("stu.")}
    assert tower_norms == {
        "preprocessor.content",
        "preprocessor.extra_ids",
        "preprocessor.action",
        "item_tower",
        "head",
        "postprocessor",
    }


@pytest.mark.parametrize(
    "query_time, bucket",
    [
        (0, 0),  # max(0, 1e-6) / 60: bucket 0
        (60, 1),
        (3_599, 7),  # sqrt(59.98)
        (3_600, 7),  # sqrt(60) = 7.75
        (86_400 * 300, 657),  # 300 days: sqrt(432,000) = 657.3
        (60 * 2_048**2, 2_048),  # the last bucket
        (60 * 2_100**2, 2_048),  # clamped to it
        (14_880_239, 497),  # 248,003.98 minutes: IEEE fp32 sqrt gives 497.99998, torch's scalar division 498
    ],
)
def test_contextual_tokens_are_bucketed_by_the_query_time(query_time, bucket):
    """The contextual rows carry timestamp 0: their bucket is int(sqrt(query_time / 60)), clamped
    to the last of the 2,049 rows; the candidate's gap is 0 (bucket 0)."""
    c = 8
    history_offsets = torch.tensor([0, 2])
    history = torch.tensor([query_time - 60, query_time - 3_600])
    q = torch.tensor([query_time])
    ts = concat_sequence_timestamps(history, history_offsets, q, c)
    assert ts[:c].tolist() == [0] * c and ts[-1] == query_time
    seq_offsets = torch.tensor([0, c + 2 + 1])
    _, buckets = positions_and_buckets(seq_offsets, ts, q, c, 8_192, 2_049, 60.0)
    assert buckets[:c].tolist() == [bucket] * c
    assert buckets[c:].tolist() == [1, 7, 0]  # history 1 and 60 minutes before, the candidate


@pytest.mark.parametrize(
    "t, hour, day",
    [
        (0, 0, 0),
        (3_599, 0, 0),  # floored: still hour 0
        (3_600, 1, 0),
        (86_399, 23, 0),
        (86_400, 0, 1),
        (86_400 * 7 - 1, 23, 6),
        (86_400 * 7, 0, 0),
        (26_000_000, 22, 6),  # 7,222.2 hours (7,222 mod 24 = 22), 300.9 days (300 mod 7 = 6)
    ],
)
def test_postprocessor_time_features_are_whole_hours_and_days(t, hour, day):
    """[cos, sin] of hour / 24 and day / 7 of a turn, the turn being 2 x 3.14 (the reference's)."""
    got = time_features(torch.tensor([t]), torch.float32)[0]
    h, d = hour / 24 * 2 * 3.14, day / 7 * 2 * 3.14
    want = torch.tensor([math.cos(h), math.sin(h), math.cos(d), math.sin(d)])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # fp32 angles; a continuous hour misses by 0.1+
    assert time_features(torch.tensor([t]), torch.bfloat16).dtype == torch.bfloat16


def test_the_postprocessor_reads_the_query_time_and_runs_its_linear_in_the_sequence_dtype():
    cfg = dataclasses.replace(SMALL, sequence_dtype="bfloat16", kernels="pytorch")
    model = DlrmHSTU(cfg, seed=0)
    batch = random_batch([0, 3, 9], seed=1)
    assert not torch.equal(batch.query_time, batch.candidate_timestamp)
    seen = {}
    model.postprocessor.register_forward_pre_hook(lambda m, args: seen.update(time=args[1]))
    model.postprocessor.linear.register_forward_hook(lambda m, args, out: seen.update(linear=out.dtype))
    model.postprocessor.norm.register_forward_hook(lambda m, args, out: seen.update(norm=out.dtype))
    model(batch, random_embeddings(batch, cfg.embedding_dim, seed=2))
    assert torch.equal(seen["time"], batch.query_time)
    assert (seen["linear"], seen["norm"]) == (torch.bfloat16, torch.float32)


def test_the_plain_backend_rounds_through_the_wire_on_several_ranks_only():
    """The fp16 all-to-all: the rows and their gradients carry fp16's rounding on several ranks; on
    one rank there is no all-to-all (TorchRec skips it, and so does the plain backend's rounding)."""
    assert load_config("synthetic-tiny").embeddings.qcomm == "fp16"  # the reference's, every preset's
    cfg = small_table_config("synthetic-tiny", "plain", 100)
    batch = random_batch([4, 0, 9], seed=3)
    out, fp16_grads = {}, {}
    for world in (1, 2):  # the forward and the backward's pending rows need no collective
        emb = make_embeddings(
            table_specs(cfg, 0, 0, 0), cfg, "cpu", 5, Cluster(0, world, 0, world, torch.device("cpu"))
        )
        out[world] = emb(batch)
        (torch.tanh(out[world].item).sum() + torch.tanh(out[world].candidate).sum()).backward()
        fp16_grads[world] = [torch.equal(g, g.half().float()) for _, g in emb.pending["item"]]
    assert all(fp16_grads[2]) and not all(fp16_grads[1])
    assert torch.equal(out[2].item, through_wire(out[1].item, torch.float16))
    assert torch.equal(out[2].candidate, through_wire(out[1].candidate, torch.float16))
    assert not torch.equal(out[2].item, out[1].item)


def test_every_rank_draws_the_same_dropout_stream():
    from dlrmv4.train.trainer import build_model_and_tables

    cfg = small_table_config("synthetic-tiny", "plain", 100)
    streams = []
    for rank in (0, 1):
        model, _ = build_model_and_tables(cfg, (0, 0, 0), Cluster(rank, 2, rank, 2, torch.device("cpu")))
        streams.append(torch.randint(0, 2**31 - 1, (5,), generator=model.dropout_generator).tolist())
    assert streams[0] == streams[1]


def test_the_reference_model_config():
    cfg: ModelConfig = load_config("yambda-5b").model
    assert (cfg.layer_norm_eps, cfg.mlp_layer_norm_eps, cfg.num_time_buckets) == (1e-6, 1e-5, 2_048)
