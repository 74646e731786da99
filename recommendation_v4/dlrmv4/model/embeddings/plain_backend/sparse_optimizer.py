"""The plain backend's sparse optimizer: FBGEMM's EXACT_ROWWISE_ADAGRAD (weight decay 0), which
TorchRec fuses into its backward. The update for one row that the batch touched is

    g      = sum of the row's gradients over every occurrence in the batch   (duplicates summed)
    state += sum_d(g_d**2) / D                                               (one fp32 per row)
    w     -= lr / (sqrt(state) + eps) * g

(fbgemm_gpu/codegen/genscript/optimizers.py: rowwise_adagrad(), split_weight_update_cpu and
split_precomputation). The plain backend applies it in place from the lookups' gradient rows
(``ops/rowwise_adagrad.py``: one Triton pass on GPUs, the PyTorch reference elsewhere) or from a
dense gradient where the exchange between ranks summed the rows into one (``exchange.py``).
"""

from __future__ import annotations

import torch

from dlrmv4.ops.rowwise_adagrad import rowwise_adagrad_


def rowwise_adagrad_dense_(
    weight: torch.Tensor, momentum: torch.Tensor, grad: torch.Tensor, lr: torch.Tensor, eps: float
) -> None:
    """The same update from a dense [rows, E] gradient (duplicates already summed): a row with an
    all-zero gradient changes neither its state nor its weight, as in FBGEMM."""
    touched = (grad != 0).any(1)
    momentum.add_((grad * grad).sum(1) / weight.shape[1])
    multiplier = torch.where(touched, lr / (torch.sqrt(momentum) + eps), 0.0)
    weight.sub_(grad * multiplier[:, None])


def rowwise_adagrad_step_(
    weight: torch.Tensor,
    momentum: torch.Tensor,
    grad: torch.Tensor | tuple[torch.Tensor, torch.Tensor | list[torch.Tensor]],
    lr: torch.Tensor,
    eps: float,
    kernels: str,
) -> None:
    """One table's update from a dense [rows, E] gradient or from (ids, gradient rows) pairs, the
    rows as one tensor or in pieces (``kernels``: the sparse update's implementation)."""
    if isinstance(grad, torch.Tensor):
        rowwise_adagrad_dense_(weight, momentum, grad, lr, eps)
    else:
        rowwise_adagrad_(weight, momentum, *grad, lr, eps, kernels)
