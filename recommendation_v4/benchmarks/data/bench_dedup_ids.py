"""How many of a rank's history ids are distinct (``embeddings.dedup_ids``), and what finding them
costs a loader worker.

For consecutive global batches of a store's train windows in the run's order, rank 0's share of W
ranks (the run's slicing) is built as the loader builds it, and packed with and without the
distinct ids (``JaggedBatch.to_torch(dedup_ids=...)``). Reported per history feature: the distinct
ids over the tokens (what the lookup and the all-to-all carry with the switch, against without),
and the packing's time per batch with and without (one core).

    python -m dlrmv4 prepare --preset synthetic-50m --data-path data/bench50m --num-train-days 30 --if-missing
    python benchmarks/data/bench_dedup_ids.py --data-path data/bench50m
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared helpers in benchmarks/

import numpy as np
from harness import RESULTS, command_line, cpu_model, git_commit, write_results
from store_factory import prepared_store

from dlrmv4.data.batch import HISTORY_ID_FIELDS
from dlrmv4.data.loader import plan_batches, rank_share, window_order
from dlrmv4.data.sampler import build_batch, history_lengths, pack_item_sides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="synthetic-50m")
    parser.add_argument("--data-path", default="data/bench50m")
    parser.add_argument("--global-batch", type=int, default=8_192)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--batches", type=int, default=8, help="consecutive global batches measured")
    parser.add_argument("--label", default="", help="suffix of the results files")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    cfg, store = prepared_store(args.preset, args.data_path)
    offsets = np.asarray(store.window_offsets)
    windows = range(store.num_windows - 1)
    plan = plan_batches([(w, int(offsets[w + 1] - offsets[w])) for w in windows], args.global_batch, drop_last=True)
    plan = plan[: args.batches]
    if not plan:
        raise SystemExit(f"the store's train windows hold no full global batch of {args.global_batch:,}")
    item_sides = pack_item_sides(store)
    slicing = cfg.loader.rank_slicing
    orders: dict[int, np.ndarray] = {}
    rows = []
    for world in args.worlds:
        distinct, tokens, plain_s, dedup_s = [], [], [], []
        for part in plan:
            if part.window not in orders:
                orders[part.window] = window_order(store, part.window, cfg.loader.window_order, False, cfg.seed)
            order = orders[part.window]
            lengths = history_lengths(store, order[part.start : part.stop], cfg.sampler) if world > 1 else None
            share = rank_share(part, 0, world, slicing, lengths)
            batch = build_batch(store, order[share], cfg.sampler, item_sides)
            started = time.perf_counter()
            batch.to_torch()
            plain_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            packed = batch.to_torch(dedup_ids=True)
            dedup_s.append(time.perf_counter() - started)
            assert packed.unique_counts is not None
            distinct.append(packed.unique_counts)
            tokens.append(batch.total_tokens)
        shares = np.asarray(distinct, np.float64) / np.asarray(tokens, np.float64)[:, None]
        row = {
            "world": world,
            "samples_per_rank": args.global_batch // world,
            "tokens_per_rank": float(np.mean(tokens)),
            "distinct_share": {name: float(v) for name, v in zip(HISTORY_ID_FIELDS, shares.mean(0))},
            "pack_ms": 1e3 * float(np.median(plain_s)),
            "pack_dedup_ms": 1e3 * float(np.median(dedup_s)),
        }
        rows.append(row)
        print(row, flush=True)
    result = {
        "commit": git_commit(),
        "device": f"{cpu_model()} CPU, one core",
        "preset": args.preset,
        "store": cfg.dataset.name,
        "users": store.train.num_users,
        "global_batch": args.global_batch,
        "batches": len(plan),
        "windows": sorted({p.window for p in plan}),
        "window_order": cfg.loader.window_order,
        "rank_slicing": slicing,
        "command": command_line(),
        "rows": rows,
    }
    name = "dedup_ids" + (f"_{args.label}" if args.label else "")
    write_results(name, result, table(result), device="cpu", out=args.out)
    print(table(result))


def table(r: dict) -> str:
    lines = [
        f"Distinct history ids of rank 0's share ({r['store']} store of {r['users']:,} users, {r['batches']} consecutive global batches of "
        f"{r['global_batch']:,} from windows {r['windows']}, {r['window_order']} order, {r['rank_slicing']} shares; "
        f"commit {r['commit']}, {r['device']}): what the lookup and the all-to-all carry with "
        "`embeddings.dedup_ids`, over the tokens (without it: 100 %); and the loader worker's packing of a batch "
        "without and with the distinct ids.",
        "",
        "| ranks | samples per rank | tokens per rank | distinct items | distinct artists | distinct albums | "
        "packing ms | with the distinct ids ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in r["rows"]:
        share = row["distinct_share"]
        lines.append(
            f"| {row['world']} | {row['samples_per_rank']:,} | {row['tokens_per_rank']:,.0f} | "
            + " | ".join(f"{100 * share[name]:.2f}%" for name in HISTORY_ID_FIELDS)
            + f" | {row['pack_ms']:.1f} | {row['pack_dedup_ms']:.1f} |"
        )
    lines += ["", f"Command: `{r['command']}`"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
