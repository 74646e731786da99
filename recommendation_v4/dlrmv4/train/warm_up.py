"""The kernels' warm-up before RUN_START: every Triton kernel the run's steps and evals will launch is
compiled and autotuned in the initialization phase, not on the clock.

Triton compiles a kernel at its first launch for each specialization (dtypes, constexprs, whether an
integer argument is a multiple of 16) and the attention autotunes per bucket of the batch's longest
sequence (the next power of two). The warm-up runs the step's forward and backward and the eval's
forward over synthetic batches made from the config alone, never from the dataset: the rank's slice
of the global batch at the run's chunks, for every length bucket up to ``max_seq_len``, with total
token counts that are and are not multiples of 16, and evals of a full slice and of a short last
batch. Nothing it does reaches the weights or the optimizers' state:

- the lookup's rows reach the model as leaf copies (``SparseEmbeddings.warm_up_lookup``): the backward
  runs the lookup's own kernels and stops there, never reaching the tables or FBGEMM's fused update;
- the sparse optimizer's kernels run on scratch rows (``warm_up_update``); Adam's fused kernel ran
  already when its state was made (``optim.make_dense_optimizer``);
- the dense gradients are dropped, the model runs without DDP (no collective of the step), and every
  random number generator (the model's dropout stream included) is put back as it was.

So the run after it is the same run, bit for bit, as one without it (``tests/test_warm_up.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from dlrmv4.checkpoint.rng import capture_rng_state, restore_rng_state
from dlrmv4.data.synthetic_batch import synthetic_batch
from dlrmv4.train.chunks import chunk_bounds, chunked_logits
from dlrmv4.train.step import TrainStep

# The attention's tuning buckets start at 16 tokens (the shortest sequence, contextual + candidate
# tokens and one history token, rounds up to it).
_SMALLEST_BUCKET = 16
# Token counts are specialized by whether they are multiples of this (Triton's integer divisibility).
_DIVISOR = 16
# A short last eval batch (a window's remainder): its sample count is not a multiple of the divisor.
_SHORT_EVAL_SAMPLES = 3
_SEED = 0  # the synthetic batches' ids and lengths: fixed, so every rank builds the same shapes


@dataclass(frozen=True)
class WarmUpBatch:
    samples: int
    longest: int  # tokens of the longest sequence: history + contextual + candidate
    aligned: bool  # whether the batch's history tokens are a multiple of _DIVISOR
    training: bool  # a training step's forward and backward (else an eval's forward)


@dataclass(frozen=True)
class WarmUpResult:
    seconds: float
    passes: int
    buckets: int

    def describe(self) -> str:
        return (
            f"kernels compiled and tuned before RUN_START: {self.passes} warm-up passes over {self.buckets} "
            f"sequence-length buckets on synthetic batches in {self.seconds:.1f} s"
        )


def length_buckets(max_seq_len: int) -> list[int]:
    """The longest sequence of one batch in each tuning bucket: every power of two from the smallest
    bucket up to the one holding ``max_seq_len``, the last clipped to it."""
    out, top = [], _SMALLEST_BUCKET
    while True:
        out.append(min(top, max_seq_len))
        if top >= max_seq_len:
            return out
        top *= 2


def warm_up_batches(max_seq_len: int, samples: int) -> list[WarmUpBatch]:
    """What the warm-up runs: per length bucket, two training slices (token counts a multiple of 16 and
    not: the step's sample count is fixed) and evals of a full slice and of a short last batch (a
    window's remainder), each with token counts a multiple of 16 and not, and of a single sample."""
    out = []
    for longest in length_buckets(max_seq_len):
        out += [WarmUpBatch(samples, longest, aligned, True) for aligned in (True, False)]
        for count in dict.fromkeys((samples, min(samples, _SHORT_EVAL_SAMPLES))):
            out += [WarmUpBatch(count, longest, aligned, False) for aligned in (True, False)]
        out.append(WarmUpBatch(1, longest, False, False))
    return out


def history_lengths(shape: WarmUpBatch, context_tokens: int, rng: np.random.Generator) -> np.ndarray:
    """History tokens per sample: one sample at the bucket's longest, the others at random up to it,
    their total a multiple of ``_DIVISOR`` or not as ``shape.aligned`` says (where the slice can be)."""
    longest = max(shape.longest - context_tokens, 1)
    hist = rng.integers(1, longest + 1, shape.samples)
    hist[0] = longest
    off = int(hist.sum()) % _DIVISOR
    moves: tuple[int, ...] = ()
    if shape.aligned and off:
        moves = (-off, _DIVISOR - off)
    elif not shape.aligned and not off:
        moves = (1, -1)
    for move in moves:  # the first that the other samples can absorb within [1, longest]
        moved = _spread(hist, move, longest)
        if moved is not None:
            hist = moved
            break
    return hist.astype(np.int32)


def _spread(hist: np.ndarray, change: int, longest: int) -> np.ndarray | None:
    """``hist`` with ``change`` tokens added over samples 1.. (each within [1, longest]); None where they
    cannot take it."""
    out = hist.copy()
    for i in range(1, len(out)):
        room = longest - out[i] if change > 0 else 1 - out[i]
        move = min(change, room) if change > 0 else max(change, room)
        out[i] += move
        change -= move
        if change == 0:
            return out
    return None


def warm_up(
    step: TrainStep, samples: int, table_rows: dict[str, int], max_seq_len: int, dedup_ids: bool
) -> WarmUpResult:
    """Compile and autotune the step's and the eval's kernels on synthetic batches of this rank's slice
    (``samples`` samples in ``step.chunks`` chunks); every rank runs the same batches in the same order."""
    started = time.perf_counter()
    model, embeddings = step.model, step.embeddings
    device = next(model.parameters()).device
    context_tokens = model.num_contextual + 1
    generators = {"dropout": model.dropout_generator}
    rng_state = capture_rng_state(generators)
    counters = embeddings.lookups_distributed_ahead, embeddings.ids_looked_up
    rng = np.random.default_rng(_SEED)
    shapes = warm_up_batches(max_seq_len, samples)
    for shape in shapes:
        lengths = history_lengths(shape, context_tokens, rng)
        batch = synthetic_batch(lengths, table_rows, rng, dedup_ids=dedup_ids).to(device)
        bounds = tuple(chunk_bounds(batch.num_samples, step.chunks))
        if shape.training:
            emb = embeddings.warm_up_lookup(batch, bounds)
            step.forward_backward(batch, emb, model.slice_context(batch), bounds, model)
            embeddings.warm_up_update(batch)
            model.zero_grad(set_to_none=True)
        else:
            model.eval()
            with torch.no_grad():
                chunked_logits(model, batch, embeddings(batch, bounds), step.chunks)
            model.train()
        del batch
    restore_rng_state(rng_state, generators)
    embeddings.lookups_distributed_ahead, embeddings.ids_looked_up = counters  # the report counts the run's
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the warm-up's many shapes leave cached blocks the run would not reuse
    buckets = len(length_buckets(max_seq_len))
    return WarmUpResult(time.perf_counter() - started, len(shapes), buckets)


def warm_up_wanted(setting: str, kernels_in_use: str) -> bool:
    """``train.warm_up``: auto warms up where the model runs its Triton kernels (nothing compiles for
    the PyTorch reference ops)."""
    return setting == "true" or (setting == "auto" and kernels_in_use == "triton")
