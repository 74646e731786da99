"""Hot ids on row-wise sharded tables over two gloo ranks (benchmarks/scale/bench_hot_ids.py --smoke):
Zipf(1.2) ids put about a fifth of the lookups on one id, the rank owning the popular rows serves
most of both ranks' lookups, and the fp16 all-to-all with the low-memory encoder carries it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # two processes with TorchRec tables

pytest.importorskip("torchrec")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "scale" / "bench_hot_ids.py"


def test_zipf_ids_load_the_rank_with_the_popular_rows():
    env = dict(os.environ, PYTHONPATH=str(BENCH.parents[2]), PYTHONWARNINGS="ignore")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--processes",
            "2",
            "--smoke",
            "--qcomms",
            "fp16",
            "--skews",
            "0",
            "1.2",
            "--steps",
            "2",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = re.findall(r"^\| (uniform|Zipf\(1\.2\)) \| fp16 \| ([\d.]+)% \| (\d) \| ([\d.]+) \|", proc.stdout, re.M)
    by = {(ids, int(rank)): (float(share), float(served)) for ids, share, rank, served in rows}
    assert set(by) == {(ids, r) for ids in ("uniform", "Zipf(1.2)") for r in (0, 1)}, proc.stdout
    hot_share, hot_served = by[("Zipf(1.2)", 0)]
    assert 12 < hot_share < 30  # the top id: about a fifth of the lookups
    assert hot_served > 1.5 and by[("Zipf(1.2)", 1)][1] < 0.5  # rank 0 owns the popular rows
    assert all(0.8 < by[("uniform", r)][1] < 1.2 for r in (0, 1))
    # The wire: what rank 0 sends back as rows, rank 1 sends again as gradients (and the reverse), and
    # the rank owning the popular rows sends far more rows than it asks for.
    wire = re.findall(
        r"^\| (uniform|Zipf\(1\.2\)) \| fp16 \|.* \| (\d) \| [^|]+\| [^|]+\| [^|]+\| [\d.,]+ "
        r"\(([\d.,]+) \+ ([\d.,]+) \+ ([\d.,]+)\) \|",
        proc.stdout,
        re.M,
    )
    sent = {(ids, int(rank)): [float(x.replace(",", "")) for x in parts] for ids, rank, *parts in wire}
    assert set(sent) == set(by), proc.stdout
    for ids in ("uniform", "Zipf(1.2)"):
        assert sent[(ids, 0)][1] == sent[(ids, 1)][2] and sent[(ids, 1)][1] == sent[(ids, 0)][2]
    assert sent[("Zipf(1.2)", 0)][1] > 10 * sent[("Zipf(1.2)", 0)][2]
