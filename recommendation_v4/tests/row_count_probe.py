"""Whether this machine's CPU kernels give a row of a result the same bits whatever other rows it is
computed with: the premise under which a step over chunks of a slice equals the step over the whole
slice bit for bit (``test_chunked_step.py``).

A chunk runs its rows of the slice through the same kernels in tensors of fewer rows. Two kinds of
kernel may then round a row differently, depending on the CPU and the libraries' builds:

* a BLAS GEMM whose blocking or code path depends on the row count (MKL in its reproducibility
  modes, for one);
* ATen's vectorised elementwise kernels, which compute a tensor's last elements (its length modulo a
  multiple of the vector width) on a scalar path; where that path rounds a transcendental function
  differently (sigmoid and SiLU under AVX2), an element's bits depend on the tensor's length.

``RowCountProbe`` records the GEMMs, the elementwise ops and the layer norms of one unchunked step
(their shapes, not their data) and runs each again on random data, once over the whole slice's rows
and once over each chunk's rows, comparing the chunk's rows bit for bit. Positions past a sample's
sequence in tensors padded to the slice's longest sequence are left out (the step masks them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROW_KERNELS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.addmm_.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.native_layer_norm.default,
    torch.ops.aten.native_layer_norm_backward.default,
}
# Elements compared per op, shape and chunk: a scalar tail rounds a few percent of its elements
# differently, so small tensors are drawn again until this many have been compared.
ELEMENTS_PER_CHECK = 4096
MAX_DRAWS = 64


@dataclass(frozen=True)
class ChunkRows:
    """The rows of every chunk, at each row count a tensor of the slice may have: ``bounds[R]`` are
    the chunks' row ranges in a tensor of R rows. ``samples_per_row[R]``: for a tensor of R rows
    whose rows are samples (or samples x heads), the sample of each row, whose ``lengths`` entry
    bounds its dims of size ``max_seq_len``."""

    bounds: dict[int, list[tuple[int, int]]]
    samples_per_row: dict[int, torch.Tensor] = field(default_factory=dict)
    lengths: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    max_seq_len: int = 0


@dataclass(frozen=True)
class _Call:
    func: torch._ops.OpOverload
    args: tuple  # the tensors as ("tensor", shape, dtype, strides) specs
    kwargs: dict
    rows: int  # the first output's rows


class RowCountProbe(TorchDispatchMode):
    """``with probe: <the unchunked step>`` records; ``probe.difference(rows)`` replays."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, _Call] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        first = _outputs(out)[:1]
        if (func in ROW_KERNELS or torch.Tag.pointwise in func.tags) and first and first[0].dim():
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            nested = [a for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple, dict))]
            nested_tensors = any(isinstance(t, torch.Tensor) for a in nested for t in _leaves(a))
            if tensors and all(t.is_floating_point() for t in tensors) and not nested_tensors:
                spec = _spec(args)
                shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
                self.calls.setdefault(f"{func.__name__} of {shapes}", _Call(func, spec, kwargs, first[0].shape[0]))
        return out

    def difference(self, rows: ChunkRows, seed: int = 0) -> str | None:
        """None when every recorded kernel gives each chunk's rows the whole slice's bits; else which
        kernel and shape does not (the first found)."""
        generator = torch.Generator().manual_seed(seed)
        for name, call in self.calls.items():
            count = call.rows
            for start, stop in rows.bounds.get(count, []):
                per_draw = max(1, _numel(call.args, count) // count * (stop - start))
                for _ in range(min(MAX_DRAWS, -(-ELEMENTS_PER_CHECK // per_draw))):
                    if not _same_rows(call, count, start, stop, rows, generator):
                        return f"{name}: its rows {start}-{stop} of {count} differ when computed on their own"
        return None


def _leaves(value) -> list:
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


def _spec(value):
    """A call's arguments with every tensor replaced by its shape, dtype and layout."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.stride())
    if isinstance(value, (list, tuple)):
        return type(value)(_spec(v) for v in value)
    return value


def _is_tensor(spec) -> bool:
    return isinstance(spec, tuple) and len(spec) == 4 and spec[0] == "tensor"


def _numel(args, count: int) -> int:
    sizes = [torch.Size(a[1]).numel() for a in args if _is_tensor(a) and a[1] and a[1][0] == count]
    return max(sizes, default=count)


def _same_rows(call: _Call, count: int, start: int, stop: int, rows: ChunkRows, generator: torch.Generator) -> bool:
    inputs = [_draw(a, generator) if _is_tensor(a) else a for a in call.args]
    # An in-place op writes its first argument: each call gets its own copy.
    fresh = (lambda x: x.clone()) if call.func.overloadpacket.__name__.endswith("_") else (lambda x: x)
    whole = _outputs(call.func(*[fresh(x) if isinstance(x, torch.Tensor) else x for x in inputs], **call.kwargs))
    part_inputs = [
        fresh(x[start:stop]) if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == count else x for x in inputs
    ]
    part = _outputs(call.func(*part_inputs, **call.kwargs))
    for w, p in zip(whole, part):
        if w.dim() == 0 or w.shape[0] != count:
            continue  # a reduction over the rows (a weight's gradient): not a row's result
        w = w[start:stop]
        keep = _real_positions(w.shape, count, start, stop, rows)
        same = (w == p) | (w.isnan() & p.isnan())  # random inputs may be outside an op's domain
        if not (same | ~keep).all():
            return False
    return True


def _outputs(result) -> list[torch.Tensor]:
    items = result if isinstance(result, (list, tuple)) else [result]
    return [t for t in items if isinstance(t, torch.Tensor)]


def _draw(spec, generator: torch.Generator) -> torch.Tensor:
    """Random values in [-4, 4) in the recorded layout (a chunk's rows of it keep its strides)."""
    _, shape, dtype, strides = spec
    values = (torch.rand(shape, generator=generator, dtype=torch.float64) * 8 - 4).to(dtype)
    return torch.empty_strided(shape, strides, dtype=dtype).copy_(values)


def _real_positions(shape: torch.Size, count: int, start: int, stop: int, rows: ChunkRows) -> torch.Tensor:
    """True where an element of the chunk's rows is inside its sample's sequence in every dim padded
    to the slice's longest sequence (all True for a tensor whose rows are not samples)."""
    keep = torch.ones(shape, dtype=torch.bool)
    samples = rows.samples_per_row.get(count)
    if samples is None or rows.max_seq_len == 0:
        return keep
    lengths = rows.lengths[samples[start:stop]]
    for dim, size in enumerate(shape[1:], 1):
        if size == rows.max_seq_len:
            inside = torch.arange(size)[None, :] < lengths[:, None]  # [rows, size]
            view = [len(lengths)] + [1] * (len(shape) - 1)
            view[dim] = size
            keep = keep & inside.reshape(view)
    return keep
