"""The STU layer (SPEC §5.5) and the stack of them, on jagged sequences.

    n = LayerNorm(x);  [u | v | q | k] = n W_uvqk + b;  u = SiLU(u)
    attn = HSTU attention(q, k, v)     SiLU(alpha q k^T) / N, causal and target-aware, no softmax
    y = Dropout([u | attn | u * LayerNorm(attn)]);  x = x + y W_out

Everything between the two projections (SiLU, attention, output block) is one op, ``stu_mixing``:
it reads u, v, q, k as views of the projection and writes their gradients into one buffer.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dlrmv4.config import ModelConfig
from dlrmv4.model.layers import LayerNorm
from dlrmv4.ops.stu_mixing import stu_mixing


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

    def forward(self, x: torch.Tensor, seq_offsets: torch.Tensor, max_seq_len: int, dropout_seed: int) -> torch.Tensor:
        cfg = self.cfg
        h, dqk, dv = cfg.num_heads, cfg.qk_dim, cfg.v_dim
        uvqk = self.uvqk(self.input_norm(x))
        # One candidate per sequence: the target-aware mask equals the causal one stu_mixing applies.
        y = stu_mixing(uvqk, seq_offsets, max_seq_len, num_heads=h, qk_dim=dqk, v_dim=dv,
                       alpha=1.0 / math.sqrt(dqk), norm_weight=self.attn_norm_weight,
                       norm_bias=self.attn_norm_bias, eps=cfg.layer_norm_eps, dropout_p=cfg.linear_dropout,
                       seed=dropout_seed, training=self.training, kernels=cfg.kernels)
        # x + y W_out^T in one GEMM: the residual is the GEMM's C operand, not a separate pass.
        return torch.addmm(x, y, self.out.weight.t())


class STUStack(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(STULayer(cfg) for _ in range(cfg.num_layers))

    def forward(self, x: torch.Tensor, seq_offsets: torch.Tensor, max_seq_len: int,
                dropout_seeds: list[int]) -> torch.Tensor:
        for layer, seed in zip(self.layers, dropout_seeds):
            x = layer(x, seq_offsets, max_seq_len, seed)
        return x
