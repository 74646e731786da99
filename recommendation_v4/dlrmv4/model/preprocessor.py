"""Token features of the sequence (docs/model.md): history/candidate tokens, contextual tokens,
the jagged sequence [8 contextual | history | candidate], and the position/time encoding."""

from __future__ import annotations

import math

import torch
from torch import nn

from dlrmv4.config import ModelConfig
from dlrmv4.model.embeddings import SequenceEmbeddings
from dlrmv4.model.layers import Tower
from dlrmv4.ops.position import encode_sequences

ACTION_BITS = (1, 2, 4)  # listen_plus, like, skip: the history pool bits


class Preprocessor(nn.Module):
    bits: torch.Tensor  # a registered buffer

    def __init__(self, cfg: ModelConfig, num_contextual: int) -> None:
        super().__init__()
        e, h, d, eps, k = cfg.embedding_dim, cfg.preprocessor_hidden, cfg.d_model, cfg.mlp_layer_norm_eps, cfg.kernels
        self.cfg = cfg
        self.num_contextual = num_contextual
        # The reference re-draws these towers' Linears Xavier-normal (its transducer's init).
        self.content = Tower(e, h, d, eps, k, normal=True)
        self.extra_ids = Tower(2 * e, h, d, eps, k, normal=True)
        self.action = Tower(len(ACTION_BITS) * cfg.action_dim, h, d, eps, k, normal=True)
        self.action_vectors = nn.Parameter(torch.randn(len(ACTION_BITS), cfg.action_dim) * 0.1)
        # The candidate's label bits are never an input: it gets one learned "target action" instead.
        self.target_action = nn.Parameter(torch.randn(len(ACTION_BITS) * cfg.action_dim) * 0.1)
        # One projection per contextual feature: N(0, 2 / (E + D)) weights, zero biases (the reference's).
        projections = [nn.Linear(e, d) for _ in range(num_contextual)]
        for proj in projections:
            nn.init.normal_(proj.weight, 0.0, math.sqrt(2.0 / (e + d)))
            nn.init.zeros_(proj.bias)
        self.contextual = nn.ModuleList(projections)
        # uniform(+-sqrt(1 / buckets)), as the reference's; the time table has a row for every
        # bucket 0 .. num_time_buckets (its bound uses num_time_buckets, as the reference's does).
        p, t = cfg.num_position_buckets, cfg.num_time_buckets
        self.position_table = nn.Parameter(torch.empty(p, d).uniform_(-math.sqrt(1.0 / p), math.sqrt(1.0 / p)))
        self.time_table = nn.Parameter(torch.empty(t + 1, d).uniform_(-math.sqrt(1.0 / t), math.sqrt(1.0 / t)))
        self.register_buffer("bits", torch.tensor(ACTION_BITS), persistent=False)

    def _action_features(self, action: torch.Tensor) -> torch.Tensor:
        """[T] pool bits -> [T, 3 * action_dim]: each set bit contributes its learned vector."""
        on = (action.unsqueeze(-1) & self.bits) != 0  # [T, 3]
        return (on.unsqueeze(-1).to(self.action_vectors.dtype) * self.action_vectors).flatten(1)

    def forward(
        self,
        emb: SequenceEmbeddings,
        history_offsets: torch.Tensor,
        history_action: torch.Tensor,
        history_timestamp: torch.Tensor,
        query_time: torch.Tensor,
        dropout_seed: int = 0,
        row_offset: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (encoded sequence values [T + B*(C+1), D], seq_offsets [B+1]). The input dropout's
        mask is drawn from ``dropout_seed`` per sequence row, counting from ``row_offset``. The
        contextual rows and the tokens go to the encoding as they are: no concatenated copy."""
        b = emb.num_candidates
        # History and candidate tokens share the branch MLPs: one matmul per layer for both (the
        # embeddings come as [history rows; candidate rows] per table).
        # content + extra + action, each sum taken inside the next tower's last norm.
        content = self.content(emb.item)
        extra = self.extra_ids(emb.artist, emb.album, plus=content)
        actions = torch.cat(
            [self._action_features(history_action), self.target_action.expand(b, -1).to(self.action_vectors.dtype)]
        )
        tokens = self.action(actions, plus=extra)
        contextual = torch.stack([proj(emb.contextual[:, i]) for i, proj in enumerate(self.contextual)], 1)
        x, seq_offsets = encode_sequences(
            contextual.to(tokens.dtype),
            tokens,
            history_offsets,
            history_timestamp,
            query_time,
            self.position_table,
            self.time_table,
            math.sqrt(self.cfg.d_model),
            self.cfg.time_bucket_seconds,
            kernels=self.cfg.kernels,
            dropout_p=self.cfg.input_dropout,
            seed=dropout_seed,
            training=self.training,
            row_offset=row_offset,
        )
        return x, seq_offsets
