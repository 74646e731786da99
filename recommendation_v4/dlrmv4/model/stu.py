"""The STU layer (docs/model.md) and the stack of them, on jagged sequences.

    n = LayerNorm(x);  [u | v | q | k] = n W_uvqk + b;  u = SiLU(u)
    attn = HSTU attention(q, k, v)     SiLU(alpha q k^T) / N, causal and target-aware, no softmax
    y = Dropout([u | attn | u * LayerNorm(attn)]);  x = x + y W_out

The layer is one op, ``stu_layer`` (``ops/stu_layer.py``), which also decides what the backward
recomputes (``ModelConfig.recompute``: none, cheap, layer; ``auto`` is resolved by the memory plan
before a run, and a model built without one keeps everything). Everything between the two
projections (SiLU, attention, output block) is ``stu_mixing``: it reads u, v, q, k as views of the
projection and writes their gradients into one buffer.

The stack returns the candidate rows only (each sequence's last), the sole rows the loss reads. With
``ModelConfig.last_layer = "candidates"`` the last layer computes nothing else
(``ops/stu_candidate_layer.py``: the same function, a fraction of the work); with ``all`` it runs
in full and the last rows are taken after it.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from dlrmv4.config import ModelConfig
from dlrmv4.model.layers import LayerNorm
from dlrmv4.ops.jagged import take_last
from dlrmv4.ops.stu_candidate_layer import stu_candidate_layer
from dlrmv4.ops.stu_layer import stu_layer


class STULayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, dqk, dv, d = cfg.num_heads, cfg.qk_dim, cfg.v_dim, cfg.d_model
        self.cfg = cfg
        self.input_norm = LayerNorm(d, cfg.layer_norm_eps, cfg.kernels)
        self.uvqk = nn.Linear(d, h * (2 * dv + 2 * dqk))
        self.attn_norm_weight = nn.Parameter(torch.ones(h * dv))
        self.attn_norm_bias = nn.Parameter(torch.zeros(h * dv))
        self.out = nn.Linear(3 * h * dv, d, bias=False)
        nn.init.xavier_uniform_(self.uvqk.weight)
        nn.init.zeros_(self.uvqk.bias)
        nn.init.xavier_uniform_(self.out.weight)

    def forward(
        self,
        x: torch.Tensor,
        seq_offsets: torch.Tensor,
        max_seq_len: int,
        dropout_seed: int,
        row_offset: int = 0,
        candidates_only: bool = False,
        consume_input: bool = False,
    ) -> torch.Tensor:
        """x [T, D] -> [T, D], or [B, D] (each sequence's last row) with ``candidates_only``;
        ``consume_input``: without gradients the output may be written over x (``stu_layer``)."""
        cfg = self.cfg
        # One candidate per sequence: the target-aware mask equals the causal one stu_mixing applies.
        extra = {} if candidates_only else {"consume_input": consume_input, "attention": cfg.attention_kernels}
        op = stu_candidate_layer if candidates_only else stu_layer
        return op(
            x,
            seq_offsets,
            max_seq_len,
            norm_weight=self.input_norm.weight,
            norm_bias=self.input_norm.bias,
            norm_eps=cfg.layer_norm_eps,
            uvqk_weight=self.uvqk.weight,
            uvqk_bias=self.uvqk.bias,
            attn_norm_weight=self.attn_norm_weight,
            attn_norm_bias=self.attn_norm_bias,
            out_weight=self.out.weight,
            num_heads=cfg.num_heads,
            qk_dim=cfg.qk_dim,
            v_dim=cfg.v_dim,
            alpha=1.0 / math.sqrt(cfg.qk_dim),
            attn_eps=cfg.layer_norm_eps,
            dropout_p=cfg.linear_dropout,
            seed=dropout_seed,
            training=self.training,
            row_offset=row_offset,
            recompute="none" if cfg.recompute == "auto" else cfg.recompute,
            kernels=cfg.kernels,
            **extra,
        )


class STUStack(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(STULayer(cfg) for _ in range(cfg.num_layers))

    def forward(
        self,
        x: torch.Tensor,
        seq_offsets: torch.Tensor,
        max_seq_len: int,
        dropout_seeds: Sequence[int],
        row_offset: int = 0,
        consume_input: bool = False,
    ) -> torch.Tensor:
        """x [T, D] -> the candidate rows [B, D]. ``max_seq_len``: the attention's N (the longest
        sequence of the step's slice); dropout masks are drawn per sequence row, counting from
        ``row_offset``. ``consume_input``: without gradients (the eval) x's memory may hold the
        layers' outputs, each written over its input instead of into a copy."""
        *body, last = self.layers
        seeds = list(dropout_seeds)
        if len(seeds) != len(self.layers):
            raise ValueError(f"STUStack: {len(seeds)} dropout seeds for {len(self.layers)} layers")
        for i, (layer, seed) in enumerate(zip(body, seeds)):
            # Past the first layer x is the stack's own; only the caller's input may need keeping.
            x = layer(x, seq_offsets, max_seq_len, seed, row_offset, consume_input=consume_input or i > 0)
        if self.cfg.last_layer == "candidates":
            return last(x, seq_offsets, max_seq_len, seeds[-1], row_offset, candidates_only=True)
        return take_last(
            last(x, seq_offsets, max_seq_len, seeds[-1], row_offset), seq_offsets, kernels=self.cfg.kernels
        )
