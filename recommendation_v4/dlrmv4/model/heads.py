"""After the sequence model (SPEC §5.6-5.8): postprocessor, item tower, logit head. All fp32."""

from __future__ import annotations

import math

import torch
from torch import nn

from dlrmv4.config import ModelConfig
from dlrmv4.model.layers import LayerNorm, SwishLayerNorm, Tower, init_linear

SECONDS_PER_HOUR = 3_600
HOURS_PER_DAY = 24
SECONDS_PER_DAY = 86_400
DAYS_PER_WEEK = 7
NUM_TIME_FEATURES = 4


def time_features(timestamp: torch.Tensor) -> torch.Tensor:
    """[sin, cos] of the hour-of-day and day-of-week phases: [B] seconds -> [B, 4]."""
    t = timestamp.to(torch.float64)
    hour = torch.remainder(t / SECONDS_PER_HOUR, HOURS_PER_DAY) * (2 * math.pi / HOURS_PER_DAY)
    day = torch.remainder(t / SECONDS_PER_DAY, DAYS_PER_WEEK) * (2 * math.pi / DAYS_PER_WEEK)
    return torch.stack([hour.sin(), hour.cos(), day.sin(), day.cos()], -1).to(torch.float32)


class Postprocessor(nn.Module):
    """Candidate output ‖ time features -> Linear(D + 4 -> D) -> LayerNorm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.linear = init_linear(nn.Linear(cfg.d_model + NUM_TIME_FEATURES, cfg.d_model))
        self.norm = LayerNorm(cfg.d_model, cfg.layer_norm_eps, cfg.kernels)

    def forward(self, user: torch.Tensor, candidate_timestamp: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(torch.cat([user.float(), time_features(candidate_timestamp)], -1)))


class ItemTower(Tower):
    """(item ‖ artist ‖ album) candidate embeddings -> the item representation."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(3 * cfg.embedding_dim, cfg.item_tower_hidden, cfg.d_model, cfg.layer_norm_eps, cfg.kernels)


class LogitHead(nn.Sequential):
    """MLP(user ⊙ item): Linear(D -> hidden) -> SwishLayerNorm -> Linear(hidden -> 1)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(
            init_linear(nn.Linear(cfg.d_model, cfg.head_hidden)),
            SwishLayerNorm(cfg.head_hidden, cfg.layer_norm_eps, cfg.kernels),
            init_linear(nn.Linear(cfg.head_hidden, 1)),
        )
