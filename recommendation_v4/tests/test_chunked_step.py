"""A chunked step is the unchunked step: one lookup, the dense model over 1, 2 or 3 chunks of the
slice, one sparse update, one Adam step.

On every CPU, in fp32 with dropout on: the sparse updates and the Adagrad momenta agree to fp32
rounding of the largest update, the same table rows are updated and every other row is left as it
was, bit for bit, and the losses and dense gradients agree to fp32 rounding. The dense gradients
are sums over the slice's rows whose order a chunk changes (a GEMM over a chunk's rows, then the sum
over chunks), so they agree to fp32 rounding, and so do the dense weights after Adam (its first step
moves every weight by about the learning rate, whatever the gradient's size, so rounding in a
near-zero gradient shows as a fraction of a step).

Every per-row quantity (the loss of each sample, the logits, the embedding gradients and so the
tables after the row-wise Adagrad update) is bit-equal where the CPU's kernels give a row the same
bits whatever the row count of the tensor it is computed in. That depends on the CPU and the
libraries' builds (an MKL GEMM in a reproducibility mode, ATen's AVX2 sigmoid over the per-sample
logits, ``row_count_probe.py``), so the bit-for-bit tests first run the step's kernels at its shapes
over the whole slice and over each chunk, and skip, naming the kernel, where a row differs. Both
backends; one process here, two (gloo, DDP) in ``test_chunked_step_on_two_ranks``.

The bit-equal tests run the full last layer (``last_layer = "all"``). The default last layer for
the candidate rows only gives per-row results that the CPU rounds differently with the chunk's
token count in some rows (measured: 1e-9-scale differences in the input gradient with the same
inputs, weights and output gradient), so with it the chunked step is checked to fp32 rounding
(``test_chunked_step_with_the_candidate_last_layer``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from model_inputs import random_batch
from row_count_probe import RowCountProbe
from step_setup import chunk_rows, small_table_config

from dlrmv4.model.embeddings import SequenceEmbeddings
from dlrmv4.train.chunks import chunk_bounds, chunked_logits
from dlrmv4.train.trainer import build_step

TORCHREC = pytest.param(
    "torchrec",
    marks=pytest.mark.skipif(
        __import__("importlib").util.find_spec("torchrec") is None, reason="torchrec not installed"
    ),
)
BACKENDS = ["plain", TORCHREC]
ROWS = 100  # random_batch draws ids below 100: duplicates within and across samples
LENGTHS = [0, 7, 30, 1, 12, 25, 3, 0, 19, 8, 30, 2, 14, 5, 22, 9, 0, 16, 11, 27, 4, 6, 13, 1]
DROPOUT = {"input_dropout": 0.2, "linear_dropout": 0.1, "kernels": "pytorch", "last_layer": "all"}
CANDIDATE_LAST_LAYER = {**DROPOUT, "last_layer": "candidates"}
LR = 0.01
GRAD_RTOL = 1e-5  # of the gradient tensor's largest element: fp32 sums over the slice in another order
STEP_ATOL = 1e-3 * LR  # a thousandth of one Adam step
ADAM_STEEP = 1e3 * 1e-8  # gradients below a thousand Adam epsilons: the step is steep in g there


def assert_dense_close(run: dict, reference: dict, label: str) -> None:
    for name, grad in reference["grads"].items():
        scale = float(grad.abs().max()) or 1.0
        torch.testing.assert_close(
            run["grads"][name],
            grad,
            rtol=0,
            atol=GRAD_RTOL * scale,
            msg=lambda m, n=name: f"{label}, gradient of {n}: {m}",
        )
    for name, value in reference["dense"].items():
        # Where a gradient is within a few hundred Adam epsilons of 0, Adam's step g / (|g| + eps)
        # turns its fp32 rounding (checked above) into a much larger change of the step: there the
        # weights must agree within one step; elsewhere within a thousandth of one.
        steep = reference["grads"][name].abs() < ADAM_STEEP
        loose = torch.where(steep, torch.full_like(value, LR), torch.full_like(value, STEP_ATOL))
        assert ((run["dense"][name] - value).abs() <= loose).all(), f"{label}, {name}: weights differ"


def assert_tables_equal(run: dict, reference: dict, label: str) -> None:
    for name, table in reference["tables"].items():
        for part in ("weight", "momentum"):
            assert torch.equal(run["tables"][name][part], table[part]), (
                f"{label}: {name}.{part} differs, although the step's kernels give each chunk's rows "
                "the whole slice's bits on this CPU (row_count_probe.py)"
            )


def assert_same_rows_updated(run: dict, reference: dict, start: dict, label: str) -> None:
    """Bit for bit whatever the kernels round: the rows the sparse update touched (a positive
    momentum) and every other row's weight and momentum."""
    for name, table in reference["tables"].items():
        touched = table["momentum"] > 0
        assert torch.equal(run["tables"][name]["momentum"] > 0, touched), f"{label}: {name}: other rows updated"
        for part in ("weight", "momentum"):
            got, before = run["tables"][name][part][~touched], start[name][part][~touched]
            assert torch.equal(got, before), f"{label}: {name}.{part} of a row no sample looked up"


def skip_unless_rows_alike(probe: RowCountProbe, rows) -> None:
    """Skip a bit-for-bit check where one of the step's kernels rounds a row by the row count."""
    difference = probe.difference(rows)
    if difference is not None:
        pytest.skip(f"not bit-equal on this CPU: {difference} (its fp32-rounding test checks the step here)")


def config(backend: str, chunks: int, model: dict = DROPOUT):
    # No rounding on the all-to-all (on two ranks): chunking is compared at fp32 precision, where
    # the fp16 wire would turn an fp32 rounding of a gradient into an fp16 one.
    train = {"chunks": chunks, "learning_rate": LR, "warmup_steps": 0}
    return small_table_config("synthetic-tiny", backend, ROWS, model=model, train=train, qcomm="none")


pytestmark = pytest.mark.usefixtures("gloo_world_of_one")


def run_steps(backend: str, chunks: int, batches, model: dict = DROPOUT) -> dict:
    step = build_step(config(backend, chunks, model), (0, 0, 0), "cpu", seed=3)
    losses = [step(batch, i, 0) for i, batch in enumerate(batches)]
    tables = step.embeddings.state_for_checkpoint()["tables"]
    return {
        "losses": torch.stack(losses),
        "dense": {k: v.clone() for k, v in step.model.state_dict().items()},
        "grads": dense_grads(step.model),
        "tables": tables,
        "step": step,
    }


def dense_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The last step's dense gradients (after clipping; the next step zeroes them)."""
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_chunk_bounds_split_the_slice_evenly():
    assert chunk_bounds(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert chunk_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert chunk_bounds(2, 5) == [(0, 1), (1, 2)]  # never an empty chunk
    with pytest.raises(ValueError, match="at least 1"):
        chunk_bounds(8, 0)


@pytest.fixture(scope="module")
def one_step():
    """backend -> (the step over 1, 2 and 3 chunks of one batch, the tables before it, a probe that
    recorded the unchunked step's kernels, the chunks' rows); each backend's steps run once."""
    done = {}

    def steps(backend: str):
        if backend not in done:
            batch, probe = random_batch(LENGTHS, seed=5), RowCountProbe()
            with probe:
                whole = run_steps(backend, 1, [batch])
            start = build_step(config(backend, 1), (0, 0, 0), "cpu", seed=3).embeddings.state_for_checkpoint()
            runs = {1: whole, **{k: run_steps(backend, k, [batch]) for k in (2, 3)}}
            done[backend] = runs, start["tables"], probe, chunk_rows(whole["step"].model, batch, (2, 3))
        return done[backend]

    return steps


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_chunked_step_equals_the_unchunked_step(backend, one_step):
    runs, start, _, _ = one_step(backend)
    for k in (2, 3):
        assert_tables_close(runs[k], runs[1], start, f"{k} chunks")
        assert_same_rows_updated(runs[k], runs[1], start, f"{k} chunks")
        torch.testing.assert_close(runs[k]["losses"], runs[1]["losses"], rtol=1e-6, atol=0)
        assert_dense_close(runs[k], runs[1], f"{k} chunks")


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_chunked_step_is_the_unchunked_step_bit_for_bit(backend, one_step):
    """The tables after the sparse update: bit-equal (per-row gradients, one update), where the
    step's kernels give a chunk's rows the whole slice's bits."""
    runs, _, probe, rows = one_step(backend)
    skip_unless_rows_alike(probe, rows)
    for k in (2, 3):
        assert_tables_equal(runs[k], runs[1], f"{k} chunks")


@pytest.mark.parametrize("dedup_ids", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_lookup_lays_the_rows_out_chunk_by_chunk(backend, dedup_ids):
    """A chunked step asks the lookup for its chunks' layout. TorchRec's lookup gives it (each chunk's
    history rows, then its candidates'), so a chunk's rows are a view of the slice's, equal to the
    rows the whole batch's layout gives; the plain backend keeps the whole batch's layout, whose
    chunks are copies of two pieces."""
    step = build_step(config(backend, 3), (0, 0, 0), "cpu", seed=3)
    batch = random_batch(LENGTHS, seed=5, dedup_ids=dedup_ids)
    bounds = tuple(chunk_bounds(batch.num_samples, 3))
    laid_out = []
    lookup = step.embeddings.forward
    with torch.no_grad():  # the rows before the step's update
        whole = lookup(batch)
    step.embeddings.forward = lambda *args: laid_out.append(lookup(*args)) or laid_out[-1]
    step(batch, 0, 0)
    (chunked,) = laid_out
    assert whole.chunks == () and chunked.chunks == (bounds if backend == "torchrec" else ())
    for start, stop in bounds:
        rows = batch.history_row(start), batch.history_row(stop)
        a, b = whole.samples(start, stop, *rows), chunked.samples(start, stop, *rows)
        for name in SequenceEmbeddings.TENSORS:
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        shares = b.item.untyped_storage().data_ptr() == chunked.item.untyped_storage().data_ptr()
        assert shares == (backend == "torchrec")
    if backend == "torchrec":
        with pytest.raises(ValueError, match="not one of the layout's chunks"):
            chunked.samples(0, 2, 0, batch.history_row(2))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_chunked_step_with_distinct_ids_is_the_unchunked_step(backend):
    """Ids deduplicated (TorchRec looks each distinct history id up once, and its gather's backward
    sums the row's token gradients): in the chunks' layout a candidate's gradient joins its row's
    sum with its chunk rather than after every history token, so the tables agree to fp32 rounding."""
    batch = random_batch(LENGTHS, seed=5, dedup_ids=True)
    runs = {k: run_steps(backend, k, [batch]) for k in (1, 3)}
    start = build_step(config(backend, 1), (0, 0, 0), "cpu", seed=3).embeddings.state_for_checkpoint()["tables"]
    assert_tables_close(runs[3], runs[1], start, "3 chunks")
    torch.testing.assert_close(runs[3]["losses"], runs[1]["losses"], rtol=1e-6, atol=0)
    assert_dense_close(runs[3], runs[1], "3 chunks")


def assert_tables_close(run: dict, reference: dict, start: dict, label: str) -> None:
    """The sparse updates to fp32 rounding of the largest update (and the Adagrad momentum)."""
    for name, table in reference["tables"].items():
        update = table["weight"] - start[name]["weight"]
        torch.testing.assert_close(
            run["tables"][name]["weight"] - start[name]["weight"],
            update,
            rtol=0,
            atol=1e-5 * float(update.abs().max()),
            msg=lambda m, n=name: f"{label}: {n}: {m}",
        )
        torch.testing.assert_close(run["tables"][name]["momentum"], table["momentum"], rtol=1e-5, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_step_with_the_candidate_last_layer(backend):
    batch = random_batch(LENGTHS, seed=5)
    runs = {k: run_steps(backend, k, [batch], CANDIDATE_LAST_LAYER) for k in (1, 2, 3)}
    start = build_step(
        config(backend, 1, CANDIDATE_LAST_LAYER), (0, 0, 0), "cpu", seed=3
    ).embeddings.state_for_checkpoint()
    for k in (2, 3):
        assert_tables_close(runs[k], runs[1], start["tables"], f"{k} chunks")
        torch.testing.assert_close(runs[k]["losses"], runs[1]["losses"], rtol=1e-6, atol=0)
        assert_dense_close(runs[k], runs[1], f"{k} chunks")


@pytest.mark.parametrize("backend", BACKENDS)
def test_uneven_chunks_are_handled_exactly(backend):
    """26 samples in 2, 3 and 5 chunks (13/13, 8/9/9, 5/5/5/5/6): the same step, to fp32 rounding.
    At these row counts the kernels round some rows differently even where the chunks above are
    bit-equal (MKL's GEMM over a chunk's 9 rows is not those rows of one over 26, as
    ``row_count_probe.py`` finds on an AVX-512 CPU), so the sparse updates agree to fp32 rounding."""
    batch = random_batch(LENGTHS + [17, 3], seed=6)
    runs = {k: run_steps(backend, k, [batch]) for k in (1, 2, 3, 5)}
    start = build_step(config(backend, 1), (0, 0, 0), "cpu", seed=3).embeddings.state_for_checkpoint()["tables"]
    for k in (2, 3, 5):
        assert_tables_close(runs[k], runs[1], start, f"{k} chunks")
        for name, grad in runs[1]["grads"].items():
            torch.testing.assert_close(runs[k]["grads"][name], grad, rtol=0, atol=GRAD_RTOL * float(grad.abs().max()))
        torch.testing.assert_close(runs[k]["losses"], runs[1]["losses"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_steps_follow_the_unchunked_trajectory(backend):
    batches = [random_batch(np.random.default_rng(i).integers(0, 31, 24), seed=20 + i) for i in range(4)]
    losses = {k: run_steps(backend, k, batches)["losses"] for k in (1, 3)}
    torch.testing.assert_close(losses[3], losses[1], rtol=1e-5, atol=0)


@pytest.mark.parametrize("bits", [False, True], ids=["fp32", "bits"])
def test_chunks_use_the_slice_dropout_masks(bits):
    """Dropout on: a chunk that drew its own masks (row offset 0, its own N) would differ far above
    fp32 noise; the slice's masks give the unchunked logits to fp32 rounding, and to the last bit
    where the forward's kernels give a chunk's rows the whole slice's bits."""
    step = build_step(config("plain", 1), (0, 0, 0), "cpu", seed=3)
    model, batch, probe = step.model, random_batch(LENGTHS, seed=8), RowCountProbe()
    emb = step.embeddings(batch)
    context = model.slice_context(batch)
    with probe:
        whole = model(batch, emb, context).logits
    parts = []
    for start, stop in chunk_bounds(batch.num_samples, 3):
        part = batch.samples(start, stop)
        rows = emb.samples(start, stop, batch.history_row(start), batch.history_row(stop))
        parts.append(model(part, rows, context.at_row(model.sequence_row(batch, start))).logits)
    if bits:
        skip_unless_rows_alike(probe, chunk_rows(model, batch, [3]))
        assert torch.equal(torch.cat(parts), whole)
    else:
        torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-6)
    naive = model(
        batch.samples(0, 8), emb.samples(0, 8, 0, batch.history_row(8)), model.slice_context(batch.samples(0, 8))
    ).logits
    assert not torch.allclose(naive, whole[:8], rtol=1e-3)


@pytest.mark.parametrize("bits", [False, True], ids=["fp32", "bits"])
def test_chunked_eval_logits_equal_the_whole_slice(bits):
    step = build_step(config("plain", 1), (0, 0, 0), "cpu", seed=4)
    step.model.eval()
    batch, probe = random_batch(LENGTHS, seed=9), RowCountProbe()
    with torch.no_grad():
        emb = step.embeddings(batch)
        with probe:
            whole = chunked_logits(step.model, batch, emb, 1)
        chunked = chunked_logits(step.model, batch, emb, 3)
    if bits:
        skip_unless_rows_alike(probe, chunk_rows(step.model, batch, [3]))
        assert torch.equal(chunked, whole)
    else:
        torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_step_on_two_ranks(backend, tmp_path):
    """Two gloo ranks with DDP and each rank's half of the global batch: 1, 2 and 3 chunks give the
    same tables and dense weights after a step, to fp32 rounding (slices of 12 samples in chunks of
    6 and 4: the CPU BLAS may round a row differently with the GEMM's row count, which a row's
    gradient then carries into the tables)."""
    worker = Path(__file__).parent / "chunk_worker.py"
    paths = [Path(__file__).parents[1], Path(__file__).parent, Path(__file__).parents[1] / "benchmarks"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, paths)), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(worker),
        backend,
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    runs = {k: torch.load(tmp_path / f"chunks{k}.pt") for k in (1, 2, 3)}
    for k in (2, 3):
        assert_tables_close(runs[k], runs[1], runs[1]["start"], f"two ranks, {k} chunks")
        assert_dense_close(runs[k], runs[1], f"two ranks, {k} chunks")
        torch.testing.assert_close(runs[k]["loss"], runs[1]["loss"], rtol=1e-6, atol=0)
    assert json.loads((tmp_path / "world.json").read_text()) == {"world_size": 2}
