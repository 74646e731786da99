"""How evenly the ranks' shares of a global batch are loaded, by rank slicing (``loader.rank_slicing``).

A step ends when the slowest rank ends, and a rank's step time grows with its tokens (and, in the
attention, with the squares of its sequence lengths). For consecutive global batches of a store's
train windows in the run's order, each slicing's shares are formed for W ranks and compared:
the largest rank's tokens over the mean rank's (1.00 = perfectly even; what the others wait
for), the same for the attention's work (sum of squared lengths), and for ``balanced`` what
forming the shares costs a loader worker per global batch (``history_lengths`` of every sample of
the batch plus the assignment) against building its own share's batch.

    python -m dlrmv4 prepare --preset synthetic-50m --data-path data/bench50m --num-train-days 30 --if-missing
    python benchmarks/data/bench_rank_balance.py --data-path data/bench50m
    python -m dlrmv4 prepare --preset synthetic-tiny --data-path data/benchtiny --if-missing
    python benchmarks/data/bench_rank_balance.py --preset synthetic-tiny --data-path data/benchtiny --max-seq-len 1033 \
        --global-batch 512 --label tiny
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared helpers in benchmarks/

import numpy as np
from harness import RESULTS, command_line, cpu_model, git_commit, write_results

from dlrmv4.config import SamplerConfig
from dlrmv4.config_loading import load_config
from dlrmv4.data.hashing import NUM_CONTEXTUAL
from dlrmv4.data.loader import RANK_SLICINGS, BatchSlice, balanced_shares, plan_batches, rank_share, window_order
from dlrmv4.data.paths import store_dir
from dlrmv4.data.sampler import build_batch, history_lengths, pack_item_sides
from dlrmv4.data.store import open_store


def share_loads(tokens: np.ndarray, part: BatchSlice, world: int, slicing: str) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, attention work) of every rank's share of one batch."""
    shares = [rank_share(part, r, world, slicing, tokens) - part.start for r in range(world)]
    return (
        np.array([tokens[s].sum() for s in shares], dtype=np.float64),
        np.array([np.square(tokens[s].astype(np.float64)).sum() for s in shares]),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="synthetic-50m")
    parser.add_argument("--data-path", default="data/bench50m")
    parser.add_argument("--global-batch", type=int, default=8_192)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--batches", type=int, default=40, help="consecutive global batches measured")
    parser.add_argument("--max-seq-len", type=int, default=0, help="the sampler's budget (0: the preset's)")
    parser.add_argument("--label", default="", help="suffix of the results files")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    overrides = {("dataset", "data_path"): args.data_path}
    if args.max_seq_len:
        overrides[("sampler", "max_seq_len")] = args.max_seq_len
        overrides[("model", "num_position_buckets")] = max(args.max_seq_len, 2_048)  # checked against it
    cfg = load_config(args.preset, None, overrides)
    path = store_dir(cfg.dataset)
    if not (path / "meta.json").exists():
        raise SystemExit(f"no store at {path}: prepare it first (see this script's docstring)")
    store = open_store(path)
    sampler: SamplerConfig = cfg.sampler
    offsets = np.asarray(store.window_offsets)
    train_windows = range(store.num_windows - 1)
    plan = plan_batches(
        [(w, int(offsets[w + 1] - offsets[w])) for w in train_windows], args.global_batch, drop_last=True
    )[: args.batches]
    if not plan:
        raise SystemExit(f"the store's train windows hold no full global batch of {args.global_batch:,}")
    item_sides = pack_item_sides(store)
    orders: dict[int, np.ndarray] = {}
    batches = []
    for part in plan:
        if part.window not in orders:
            orders[part.window] = window_order(store, part.window, cfg.loader.window_order, False, cfg.seed)
        anchors = orders[part.window][part.start : part.stop]
        started = time.perf_counter()
        lengths = history_lengths(store, anchors, sampler)
        lengths_s = time.perf_counter() - started
        batches.append((part, anchors, lengths + NUM_CONTEXTUAL + 1, lengths_s))

    rows = []
    for world in args.worlds:
        for slicing in RANK_SLICINGS:
            token_ratio, work_ratio = [], []
            for part, _, tokens, _ in batches:
                local = BatchSlice(part.window, 0, len(tokens))
                per_rank, work = share_loads(tokens, local, world, slicing)
                token_ratio.append(per_rank.max() / per_rank.mean())
                work_ratio.append(work.max() / work.mean())
            row = {
                "world": world,
                "slicing": slicing,
                "tokens_max_over_mean": float(np.mean(token_ratio)),
                "tokens_worst": float(np.max(token_ratio)),
                "work_max_over_mean": float(np.mean(work_ratio)),
                "work_worst": float(np.max(work_ratio)),
            }
            if slicing == "balanced":
                assign_s, build_s = [], []
                for part, anchors, tokens, lengths_s in batches[:8]:
                    started = time.perf_counter()
                    share = balanced_shares(tokens, world)[0]
                    assign_s.append(lengths_s + time.perf_counter() - started)
                    started = time.perf_counter()
                    build_batch(store, anchors[share], sampler, item_sides)
                    build_s.append(time.perf_counter() - started)
                row.update(
                    share_ms=1e3 * float(np.mean(assign_s)),
                    build_ms=1e3 * float(np.mean(build_s)),
                    share_over_build=float(np.mean(assign_s) / np.mean(build_s)),
                )
            rows.append(row)
            print(json.dumps(row), flush=True)

    mean_tokens = float(np.mean([t.mean() for _, _, t, _ in batches]))
    result = {
        "commit": git_commit(),
        "device": f"{cpu_model()} CPU, one core",
        "preset": args.preset,
        "max_seq_len": sampler.max_seq_len,
        "store": path.name,
        "global_batch": args.global_batch,
        "batches": len(batches),
        "windows": sorted({p.window for p, *_ in batches}),
        "mean_tokens": mean_tokens,
        "command": command_line(),
        "rows": rows,
    }
    name = "rank_balance" + (f"_{args.label}" if args.label else "")
    write_results(name, result, table(result), device="cpu", out=args.out)
    print(table(result))


def table(r: dict) -> str:
    lines = [
        f"Rank loads by rank slicing (commit {r['commit']}, {r['device']}): {r['batches']} consecutive global "
        f"batches of {r['global_batch']:,} from the {r['preset']} store (windows {r['windows'][0]}-"
        f"{r['windows'][-1]}, max_seq_len {r['max_seq_len']:,}, mean {r['mean_tokens']:,.0f} tokens per sample). max/mean: the fullest rank's "
        "load over the mean rank's, averaged over the batches (worst batch in brackets); tokens, and the "
        "attention's work (sum of squared lengths). Balancing cost: a loader worker's lengths of the whole "
        "global batch plus the assignment, per batch, against building its own share.",
        "",
        "| ranks | slicing | tokens max/mean (worst) | attention work max/mean (worst) | balancing ms / batch "
        "| building the share ms | cost share |",
        "|---:|---|---|---|---:|---:|---:|",
    ]
    for row in r["rows"]:
        cost = (
            f"{row['share_ms']:.1f} | {row['build_ms']:.1f} | {100 * row['share_over_build']:.1f}%"
            if "share_ms" in row
            else " | | "
        )
        lines.append(
            f"| {row['world']} | {row['slicing']} | {row['tokens_max_over_mean']:.4f} "
            f"({row['tokens_worst']:.4f}) | {row['work_max_over_mean']:.4f} ({row['work_worst']:.4f}) | {cost} |"
        )
    lines += ["", f"Command: `{r['command']}`", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
