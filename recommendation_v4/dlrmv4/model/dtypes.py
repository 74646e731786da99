"""The torch dtype of each ``ModelConfig.sequence_dtype`` name: the one table the model, its
embeddings and the memory planner read."""

from __future__ import annotations

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
