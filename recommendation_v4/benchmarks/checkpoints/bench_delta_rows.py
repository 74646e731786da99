"""How much of the tables one train window changes: the size of a delta checkpoint per window, against
the whole tables, from a store's real batches.

Row-wise Adagrad changes exactly the rows a training step looks up (a looked-up row gets a gradient,
nonzero but for a measure-zero set), so a window's delta holds the distinct rows its batches look
up. For each window measured, every global batch of it is built as the loader builds it and its ids
are marked, table by table (the preset's tables: ``synthetic-1b`` has Yambda-5B's users and catalog,
and the config's tables are Yambda-5B's). Reported: the rows changed, the delta's bytes (weight,
momentum and the row's id) for the whole job and for the busiest of ``--world`` ranks holding
row-wise blocks, and their share of the whole tables (of the rank's block).

    python -m dlrmv4 prepare --preset synthetic-1b --data-path data/1b
    python benchmarks/checkpoints/bench_delta_rows.py --preset synthetic-1b --data-path data/1b --windows 0 92 184 276 --label _1b

(synthetic-1b has 277 train windows; its window 0 holds no full batch of 1,024, so it changes nothing.)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared helpers in benchmarks/

import numpy as np
from harness import RESULTS, command_line, write_results
from store_factory import prepared_store

from dlrmv4.data.loader import plan_batches, window_order
from dlrmv4.data.sampler import build_batch, pack_item_sides
from dlrmv4.data.sparse_features import feature_ids
from dlrmv4.model.embeddings.tables import store_table_counts, table_features, table_specs

ID_BYTES = 8  # a delta stores each row's global id beside its weight and momentum


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="synthetic-1b")
    parser.add_argument("--data-path", default="data/1b")
    parser.add_argument("--windows", type=int, nargs="+", default=None, help="train windows (default: 4 spread)")
    parser.add_argument("--world", type=int, default=8, help="ranks holding row-wise blocks of every table")
    parser.add_argument("--label", default="", help="suffix of the results files")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    cfg, store = prepared_store(args.preset, args.data_path)
    train_windows = store.num_windows - 1
    windows = args.windows or sorted({0, train_windows // 3, 2 * train_windows // 3, train_windows - 1})
    if any(not 0 <= w < train_windows for w in windows):
        raise SystemExit(f"--windows must be train windows, 0..{train_windows - 1}")
    specs = table_specs(cfg, *store_table_counts(store))
    row_bytes = cfg.model.embedding_dim * 4 + 4  # fp32 weight and row-wise momentum
    whole_bytes = sum(s.rows for s in specs) * row_bytes
    blocks = {s.name: -(-s.rows // args.world) for s in specs}  # TorchRec's row-wise block per rank
    rank_whole = [sum(min(max(s.rows - r * blocks[s.name], 0), blocks[s.name]) for s in specs) * row_bytes
                  for r in range(args.world)]  # fmt: skip
    offsets = np.asarray(store.window_offsets)
    item_sides = pack_item_sides(store)
    gbs = cfg.loader.batch_size
    results = []
    for window in windows:
        started = time.perf_counter()
        marked = {s.name: np.zeros(s.rows, dtype=bool) for s in specs}
        order = window_order(store, window, cfg.loader.window_order, False, cfg.seed)
        plan = plan_batches([(window, int(offsets[window + 1] - offsets[window]))], gbs, drop_last=True)
        for part in plan:
            ids = feature_ids(build_batch(store, order[part.start : part.stop], cfg.sampler, item_sides).to_torch())
            for spec in specs:
                for feature in table_features(spec.name):
                    marked[spec.name][ids[feature].numpy()] = True
        per_table = {name: int(m.sum()) for name, m in marked.items()}
        per_rank = [
            sum(int(m[r * blocks[name] : (r + 1) * blocks[name]].sum()) for name, m in marked.items())
            for r in range(args.world)
        ]
        busiest = int(np.argmax(per_rank))
        changed = sum(per_table.values())
        results.append(
            {
                "window": window,
                "samples": len(plan) * gbs,
                "changed_rows": changed,
                "changed_rows_per_table": per_table,
                "delta_bytes": changed * (row_bytes + ID_BYTES),
                "share_of_whole": changed * (row_bytes + ID_BYTES) / whole_bytes,
                "busiest_rank": busiest,
                "busiest_rank_delta_bytes": per_rank[busiest] * (row_bytes + ID_BYTES),
                "busiest_rank_share": per_rank[busiest] * (row_bytes + ID_BYTES) / rank_whole[busiest],
                "seconds": time.perf_counter() - started,
            }
        )
        print(f"window {window}: {changed:,} rows changed ({results[-1]['share_of_whole']:.2%})", flush=True)
    largest = sorted(specs, key=lambda s: -s.rows)[:3]
    lines = [
        f"Rows one train window changes, from `{args.preset}`'s batches (GBS {gbs:,}, every full batch of the "
        f"window) on the preset's tables: {sum(s.rows for s in specs):,} rows of {cfg.model.embedding_dim} "
        f"fp32 with their momentum, {whole_bytes / 2**30:,.1f} GiB. A delta holds each changed row's weight, "
        f"momentum and id ({row_bytes + ID_BYTES:,} bytes); 'busiest rank': of {args.world} ranks holding "
        "row-wise blocks of every table, the one with the most changed rows, against its own block.",
        "",
        "| window | samples | rows changed | "
        + " | ".join(f"{s.name} ({s.rows:,} rows)" for s in largest)
        + f" | delta, whole job | share of the tables | busiest rank's delta | its share of its {args.world}th |",
        "|---:|---:|---:|" + "---:|" * len(largest) + "---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['window']} | {r['samples']:,} | {r['changed_rows']:,} | "
            + " | ".join(f"{r['changed_rows_per_table'][s.name]:,}" for s in largest)
            + f" | {r['delta_bytes'] / 2**30:,.2f} GiB | {r['share_of_whole']:.2%} | "
            f"{r['busiest_rank_delta_bytes'] / 2**30:,.2f} GiB | {r['busiest_rank_share']:.2%} |"
        )
    print("\n".join(lines))
    write_results(
        f"delta_rows{args.label}",
        {
            "preset": args.preset,
            "table_rows": {s.name: s.rows for s in specs},
            "embedding_dim": cfg.model.embedding_dim,
            "whole_bytes": whole_bytes,
            "world": args.world,
            "results": results,
            "command": command_line(),
        },
        "\n".join(lines),
        out=args.out,
    )


if __name__ == "__main__":
    main()
