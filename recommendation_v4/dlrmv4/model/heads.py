"""After the sequence model (docs/model.md): postprocessor, item tower, logit head.

The postprocessor's Linear runs in the sequence dtype (bf16 by default, as the reference's under its
autocast) on the candidate position's output and the time features rounded to that dtype; its layer
norm, the item tower, the head and the loss run in fp32.
"""

from __future__ import annotations

import torch
from torch import nn

from dlrmv4.config import ModelConfig
from dlrmv4.model.layers import LayerNorm, SwishLayerNorm, Tower, init_linear

# (seconds per unit, units per period): the hour of the day and the day of the week.
TIME_PERIODS = ((3_600, 24), (86_400, 7))
NUM_TIME_FEATURES = 2 * len(TIME_PERIODS)
# The reference's angle is units / period x 2 x 3.14, not x 2 pi; its RCPs were made with it.
TWO_PI_AS_THE_REFERENCE = (2, 3.14)


def time_features(timestamp: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[cos, sin] of the hour-of-day and the day-of-week phases, [B] seconds -> [B, 4] in ``dtype``:
    whole hours and days (floored, in fp32), as the reference computes them, then rounded to ``dtype``."""
    t = timestamp.to(torch.float32)
    two, almost_pi = TWO_PI_AS_THE_REFERENCE
    features = []
    for seconds, period in TIME_PERIODS:
        # Tensors, not Python numbers: a GPU divides by a host scalar as a multiply by its reciprocal.
        # Filled on the device (torch.tensor would copy from the host and wait for it).
        unit, n = (torch.full((), float(v), device=t.device) for v in (seconds, period))
        angle = torch.remainder(torch.div(t, unit, rounding_mode="floor"), n) / n * two * almost_pi
        features += [torch.cos(angle), torch.sin(angle)]
    return torch.stack(features, -1).to(dtype)


class Postprocessor(nn.Module):
    """Candidate output ‖ time features of the query time -> Linear(D + 4 -> D) -> LayerNorm."""

    def __init__(self, cfg: ModelConfig, autocast_dtype: torch.dtype) -> None:
        super().__init__()
        # Xavier-normal, as the reference re-draws it (its transducer's init).
        self.linear = init_linear(nn.Linear(cfg.d_model + NUM_TIME_FEATURES, cfg.d_model), normal=True)
        self.norm = LayerNorm(cfg.d_model, cfg.mlp_layer_norm_eps, cfg.kernels)
        self.autocast_dtype = autocast_dtype

    def forward(self, user: torch.Tensor, query_time: torch.Tensor) -> torch.Tensor:
        x = torch.cat([user, time_features(query_time, user.dtype)], -1).float()
        dtype = self.autocast_dtype
        with torch.autocast(x.device.type, dtype=dtype, enabled=dtype != torch.float32):
            y = self.linear(x)
        return self.norm(y.float())


class ItemTower(Tower):
    """(item ‖ artist ‖ album) candidate embeddings -> the item representation."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(3 * cfg.embedding_dim, cfg.item_tower_hidden, cfg.d_model, cfg.mlp_layer_norm_eps, cfg.kernels)


class LogitHead(nn.Sequential):
    """MLP(user ⊙ item): Linear(D -> hidden) -> SwishLayerNorm -> Linear(hidden -> 1)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(
            init_linear(nn.Linear(cfg.d_model, cfg.head_hidden)),
            SwishLayerNorm(cfg.head_hidden, cfg.mlp_layer_norm_eps, cfg.kernels),
            init_linear(nn.Linear(cfg.head_hidden, 1)),
        )
