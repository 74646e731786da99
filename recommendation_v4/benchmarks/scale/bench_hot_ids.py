"""Hot ids on row-wise sharded tables: each rank's peak device memory in the embedding lookup, its
all-to-alls and the fused update, with uniform and Zipf-skewed ids, by all-to-all precision.

With row-wise sharding the most popular rows of every table live on the first rank: with Zipf ids
(1.2: the top id takes about a fifth of a batch's lookups) that rank looks up and sends back a far
larger share of every rank's rows than the others, which is how the reference's hot rank ran out of
memory. Every rank holds its real share of the tables (``--real-tables-of N``: Yambda-5B's rows x
processes / N, as one of N ranks holds in the real job) and looks up ``--per-rank-batch`` samples
at the real length mix (``length_mix.jagged``), then backpropagates a gradient through the lookup
(the gradient all-to-all and FBGEMM's fused row-wise Adagrad). Reported per configuration: the
top id's share of the lookups, the rows each rank served (looked up for all ranks), each rank's
peak above its resting memory, the time per lookup + backward, and the all-to-all itself: the bytes
each rank sends per step (ids to the rows' owners, rows back, gradients to the owners) and, on GPUs,
the device time of its NCCL kernels per step (from the profiler). The tables' placement (HBM or host
memory) is the memory plan's for this machine, as in a run. Launched by torchrun:

    python benchmarks/scale/bench_hot_ids.py --processes 2 --real-tables-of 8            # 2 GPUs (nvidia-h200-x2)
    python benchmarks/scale/bench_hot_ids.py --processes 2 --smoke                        # the CPU (gloo), tiny shapes
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared helpers in benchmarks/

import numpy as np
import torch
from harness import RESULTS, command_line, device_name, git_commit, sync, write_results

from dlrmv4.distributed.liveness import exit_process


def config(args: argparse.Namespace, qcomm: str, world: int):
    """The reference model's tables at this rank's real share, TorchRec row-wise, the given all-to-all."""
    from bench_scaling import real_table_rows

    from dlrmv4.config_loading import load_config
    from dlrmv4.reference_counts import YAMBDA_5B_TABLE_COUNTS

    cfg = load_config("yambda-5b")
    cfg = dataclasses.replace(cfg, loader=dataclasses.replace(cfg.loader, batch_size=args.per_rank_batch * world))
    rows = real_table_rows(args.real_tables_of, world, YAMBDA_5B_TABLE_COUNTS if not args.smoke else (1, 1, 1))
    emb = dataclasses.replace(
        cfg.embeddings,
        embedding_backend="torchrec",
        sharding_types="*=row_wise",
        qcomm=qcomm,
        **{name: value for (section, name), value in rows.items() if section == "embeddings"},
    )
    sampler = dataclasses.replace(
        cfg.sampler, **{name: v for (section, name), v in rows.items() if section == "sampler"}
    )
    model = cfg.model if not args.smoke else dataclasses.replace(cfg.model, embedding_dim=16, sequence_dtype="float32")
    return dataclasses.replace(cfg, embeddings=emb, sampler=sampler, model=model)


def worker(args: argparse.Namespace) -> None:
    from length_mix import jagged_lengths
    from model_inputs import random_table_batch

    from dlrmv4.config import DistributedConfig
    from dlrmv4.distributed.process_start import start_cluster
    from dlrmv4.model.embeddings import make_embeddings, table_specs
    from dlrmv4.plan.explain import refusal
    from dlrmv4.plan.machine import plan_for_run
    from dlrmv4.plan.resolve import resolved_config
    from dlrmv4.reference_counts import YAMBDA_5B_TABLE_COUNTS

    world = int(os.environ["WORLD_SIZE"])
    cluster = start_cluster(DistributedConfig(), need_group=True)  # TorchRec needs a group, even of one
    device = cluster.device
    rows_out = []
    (qcomm,) = args.qcomms  # main() launches the workers once per precision
    cfg = config(args, qcomm, world)
    if not args.smoke:  # which tables fit in HBM and which live in host memory, as a run would plan it
        plan = plan_for_run(cfg, cluster, YAMBDA_5B_TABLE_COUNTS)
        if not plan.fits:
            raise SystemExit(f"[dlrmv4] error: {refusal(plan)}")
        cfg = resolved_config(plan, cfg)
    specs = table_specs(cfg, 0, 0, 0)  # config() sized every table
    embeddings = make_embeddings(specs, cfg, device, seed=0, cluster=cluster)
    table_rows = {s.name: s.rows for s in specs}
    for skew in args.skews:
        rng = np.random.default_rng([cluster.rank, int(skew * 100)])
        max_len = cfg.sampler.max_seq_len if not args.smoke else 64
        lengths = jagged_lengths("jagged", args.per_rank_batch, rng, max_len)
        batches = [random_table_batch(lengths, table_rows, rng, skew).to(device) for _ in range(args.steps + 1)]
        ids = batches[0].history_item_id
        top_share = float(torch.bincount(ids).max().float() / len(ids))
        served = rows_served(batches[0], specs, world)
        sync(device)
        resting = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        seconds = []
        for i, batch in enumerate(batches):
            sync(device)
            cluster.barrier()
            started = time.perf_counter()
            out = embeddings(batch)
            # Sums in the rows' own dtype: an fp32 copy of every output would inflate the peak.
            loss = sum(t.sum() for t in (out.item, out.artist, out.album, out.contextual))
            loss.backward()
            sync(device)
            if i:  # the first one warms up
                seconds.append(time.perf_counter() - started)
            del out, loss
        peak = (torch.cuda.max_memory_allocated(device) - resting) / 2**30 if device.type == "cuda" else None
        nccl_ms = nccl_ms_per_step(embeddings, batches[1 : 1 + PROFILED_STEPS], device, cluster)
        gathered = cluster.gather(
            {
                "rank": cluster.rank,
                "peak_gib": peak,
                "served": served,
                "ms": 1e3 * float(np.mean(seconds)),
                "nccl_ms": nccl_ms,
            }
        )
        if cluster.is_main:
            wire = all_to_all_bytes(
                [rank["served"] for rank in gathered], cfg.model.embedding_dim, ROW_BYTES[qcomm], world
            )
            for rank, sent in zip(gathered, wire):
                rank.update(sent)
            rows_out.append({"qcomm": qcomm, "skew": skew, "top_id_share": top_share, "ranks": gathered})
            print(json.dumps(rows_out[-1]), flush=True)
    if cluster.is_main:
        Path(args.worker_out).write_text(json.dumps(rows_out))
    cluster.barrier()  # no rank tears its group down while another is still in a collective
    cluster.shutdown()


PROFILED_STEPS = 3
ROW_BYTES = {"fp16": 2, "bf16": 2, "none": 4}  # bytes per element of a row on the wire, by qcomm
ID_BYTES = 8  # int64 ids in the input distribution


def all_to_all_bytes(served: list[list[int]], dim: int, row_bytes: int, world: int) -> list[dict]:
    """Bytes each rank sends to the other ranks in one step, from ``served[s][o]``: the lookups of
    rank s's batch that rank o's rows answer. The ids go to the owner, the rows come back from it
    (forward) and their gradients go to it again (backward); a rank's own rows never leave it."""
    out = []
    for rank in range(world):
        asked = sum(served[rank][o] for o in range(world) if o != rank)  # rows this rank needs from others
        answered = sum(served[s][rank] for s in range(world) if s != rank)  # rows others need from it
        out.append(
            {
                "ids_bytes": asked * ID_BYTES,
                "rows_bytes": answered * dim * row_bytes,
                "grads_bytes": asked * dim * row_bytes,
            }
        )
    return out


def nccl_ms_per_step(embeddings, batches, device, cluster) -> float | None:
    """Device time of the NCCL kernels (the all-to-alls, and any wait in them for the other ranks)
    per lookup + backward, from the profiler (None on the CPU)."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    cluster.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for batch in batches:
            out = embeddings(batch)
            sum(t.sum() for t in (out.item, out.artist, out.album, out.contextual)).backward()
            del out
        sync(device)
    micros = sum(e.device_time_total for e in prof.key_averages() if "nccl" in e.key.lower())
    return micros / 1e3 / len(batches)


def rows_served(batch, specs, world: int) -> list[int]:
    """Rows of this rank's batch each rank looks up (row-wise: table rows split into equal blocks)."""
    from dlrmv4.data.sparse_features import feature_ids
    from dlrmv4.model.embeddings import table_features

    ids = feature_ids(batch)
    served = np.zeros(world, np.int64)
    for spec in specs:
        block = -(-spec.rows // world)
        for feature in table_features(spec.name):
            served += np.bincount((ids[feature].cpu().numpy() // block), minlength=world)[:world]
    return served.tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--real-tables-of", type=int, default=8, metavar="N")
    parser.add_argument("--per-rank-batch", type=int, default=1_024)
    parser.add_argument("--skews", type=float, nargs="+", default=[0.0, 1.2], help="Zipf exponents; 0 = uniform")
    parser.add_argument("--qcomms", nargs="+", default=["fp16", "bf16", "none"], choices=("none", "fp16", "bf16"))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny tables and batches (the script runs on the CPU)")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_out:
        worker(args)
        exit_process(0)  # a rank of several: no interpreter teardown (see exit_process)
    if args.smoke:
        args.real_tables_of, args.per_rank_batch = max(args.real_tables_of, 100_000), min(args.per_rank_batch, 32)
    rows = []
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.processes))
    with tempfile.TemporaryDirectory() as tmp:
        for qcomm in args.qcomms:  # fresh processes per precision: each builds its own full-size tables
            out = Path(tmp) / f"{qcomm}.json"
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={args.processes}",
                __file__,
                *sys.argv[1:],
                "--qcomms",
                qcomm,
                "--worker-out",
                str(out),
            ]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(
                    f"the benchmark failed ({qcomm} all-to-all):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
                )
            rows += json.loads(out.read_text())
    device = (
        f"{args.processes}x {device_name('cuda')}"
        if torch.cuda.is_available()
        else f"{device_name('cpu')} CPU, {args.processes} processes"
    )
    result = {
        "commit": git_commit(),
        "device": device,
        "processes": args.processes,
        "real_tables_of": args.real_tables_of,
        "per_rank_batch": args.per_rank_batch,
        "smoke": args.smoke,
        "command": command_line(),
        "rows": rows,
    }
    print(table(result))
    if not args.smoke:
        name = "hot_ids" + (f"_{args.label}" if args.label else "")
        write_results(name, result, table(result), device="cuda" if torch.cuda.is_available() else "cpu", out=args.out)


def table(r: dict) -> str:
    lines = [
        f"Hot ids on {r['device']} (commit {r['commit']}): TorchRec row-wise, every rank holding 1/"
        f"{r['real_tables_of']} of Yambda-5B's tables, {r['per_rank_batch']:,} samples per rank at the real "
        "length mix; lookup + backward (gradient all-to-all, fused row-wise Adagrad). Peak: device memory "
        "above the rank's resting memory. Rows served: the lookups a rank makes for all ranks, over the mean. "
        "MB sent: what the rank puts on the wire per step (ids to the rows' owners, rows back to the ranks that "
        "asked, gradients to the owners). NCCL ms: device time of the NCCL kernels per step (profiler).",
        "",
        "| ids | all-to-all | top id's share | rank | rows served (x mean) | peak GiB | ms / lookup + backward "
        "| MB sent per step: ids + rows + gradients | NCCL ms per step |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in r["rows"]:
        totals = np.sum([rank["served"] for rank in row["ranks"]], axis=0)
        ids = f"Zipf({row['skew']:g})" if row["skew"] else "uniform"
        for rank in row["ranks"]:
            peak = f"{rank['peak_gib']:.2f}" if rank["peak_gib"] is not None else "n/a (CPU)"
            sent = [rank.get(k, 0) / 1e6 for k in ("ids_bytes", "rows_bytes", "grads_bytes")]
            wire = f"{sum(sent):,.1f} ({sent[0]:,.1f} + {sent[1]:,.1f} + {sent[2]:,.1f})"
            nccl = f"{rank['nccl_ms']:.1f}" if rank.get("nccl_ms") is not None else "n/a (CPU)"
            lines.append(
                f"| {ids} | {row['qcomm']} | {100 * row['top_id_share']:.1f}% | {rank['rank']} | "
                f"{totals[rank['rank']] / totals.mean():.2f} | {peak} | {rank['ms']:.1f} | {wire} | {nccl} |"
            )
    lines += ["", f"Command: `{r['command']}`"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
