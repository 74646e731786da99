"""The model at its initialisation on the real recipe: the first loss and the spread of the logits of
one rank's batch at the reference shape, next to the reference's (its first loss 0.142, its logits
spreading 0.07; docs/model.md).

Every table starts uniform(-sqrt(1 / N), +sqrt(1 / N)) with N its Yambda-5B row count. The batch
looks up only a few thousand rows, so each table is built with ``--table-rows`` rows (ids below
that) and its rows are scaled to the real N's bound: a uniform draw scaled by a constant is the
uniform draw of the scaled bound, so the looked-up rows have the real tables' distribution. The
batch has the real length mix (``length_mix.jagged``) and random labels at ``--label-rate``; the
reference's loss was measured on Yambda's labels (the loss at logits ~ 0 is 0.2 x the label
entropy, 0.139 at a rate of 0.5).

    python benchmarks/step/bench_first_step.py                  # CPU, fp32 sequence model, 16 samples
    python benchmarks/step/bench_first_step.py --batch 256      # on a GPU, bf16 (the recipe's)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared helpers in benchmarks/

import numpy as np
import torch
from harness import command_line, device_name, git_commit, write_results
from length_mix import jagged_lengths
from model_inputs import random_table_batch

from dlrmv4.config_loading import load_config
from dlrmv4.model.embeddings import make_embeddings, table_specs
from dlrmv4.model.embeddings.tables import init_bound
from dlrmv4.model.hstu import DlrmHSTU
from dlrmv4.reference_counts import YAMBDA_5B_TABLE_COUNTS

REFERENCE = {"first_loss": 0.142, "logit_std": 0.07}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16, help="samples of the batch")
    parser.add_argument("--table-rows", type=int, default=20_000, help="rows built per table (ids below)")
    parser.add_argument("--label-rate", type=float, default=0.5, help="share of positive labels")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="one model and batch per seed")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = load_config("yambda-5b")
    real_rows = {s.name: s.rows for s in table_specs(cfg, *YAMBDA_5B_TABLE_COUNTS)}
    model_cfg = cfg.model if device.type == "cuda" else dataclasses.replace(cfg.model, sequence_dtype="float32")
    cfg = dataclasses.replace(
        cfg,
        model=dataclasses.replace(model_cfg, kernels="auto" if device.type == "cuda" else "pytorch"),
        embeddings=dataclasses.replace(
            cfg.embeddings,
            embedding_backend="plain",
            item_rows=args.table_rows,
            artist_rows=args.table_rows,
            album_rows=args.table_rows,
        ),
        sampler=dataclasses.replace(
            cfg.sampler,
            **{f"{name}_rows": args.table_rows for name in real_rows if name not in ("item", "artist", "album")},
        ),
    )
    rows = []
    for seed in args.seeds:
        torch.manual_seed(seed)
        model = DlrmHSTU(cfg.model, seed=seed).to(device)
        embeddings = make_embeddings(table_specs(cfg, 0, 0, 0), cfg, device, seed)
        with torch.no_grad():
            for name, weight in embeddings.weights.items():
                weight.mul_(init_bound(real_rows[name]) / init_bound(args.table_rows))
        rng = np.random.default_rng(seed)
        batch = random_table_batch(jagged_lengths("jagged", args.batch, rng), args.table_rows, rng)
        labels = torch.from_numpy((rng.random(args.batch) < args.label_rate).astype(np.float32))
        batch = dataclasses.replace(batch, label=labels).to(device)
        with torch.no_grad():  # training mode: the first step's forward, its dropout included
            out = model(batch, embeddings(batch))
        logits = out.logits.float().cpu()
        rows.append(
            {
                "seed": seed,
                "first_loss": float(out.loss),
                "logit_mean": float(logits.mean()),
                "logit_std": float(logits.std()),
                "label_rate": float(labels.mean()),
                "mean_tokens": float(batch.total_tokens / args.batch),
            }
        )
        print(rows[-1], flush=True)
    result = {
        "device": device_name(device.type),
        "commit": git_commit(),
        "sequence_dtype": cfg.model.sequence_dtype,
        "batch": args.batch,
        "table_rows": args.table_rows,
        "reference": REFERENCE,
        "rows": rows,
        "command": command_line(),
    }
    text = table(result)
    print(text)
    if not args.no_save:
        write_results("first_step", result, text, device=device.type)


def table(r: dict) -> str:
    lines = [
        f"The model at its initialisation on {r['device']} (commit {r['commit']}): the reference shape (D 512, "
        f"3 STU layers, {r['sequence_dtype']} sequence model, the first step's dropout), every table uniform(+-sqrt(1 / N)) "
        f"with N its Yambda-5B row count, {r['batch']} samples at the real length mix, random labels. The "
        f"reference's: first loss {r['reference']['first_loss']}, logits spreading {r['reference']['logit_std']}.",
        "",
        "| seed | mean tokens | label rate | first loss (0.2 x BCE) | logit mean | logit std |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in r["rows"]:
        lines.append(
            f"| {row['seed']} | {row['mean_tokens']:,.0f} | {row['label_rate']:.2f} | {row['first_loss']:.4f} | "
            f"{row['logit_mean']:+.4f} | {row['logit_std']:.4f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
