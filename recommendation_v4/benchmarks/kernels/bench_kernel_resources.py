"""What each Triton kernel of the model takes on each target: shared memory (LDS on AMD), registers
and spills, and the occupancy they allow, from kernels compiled on this machine for MI350X
(gfx950), MI300X (gfx942), B200 (sm_100) and H100/H200 (sm_90); no GPU needed.

Shared memory is the compiled kernel's own metadata. AMD: registers, spills and the occupancy
(waves per SIMD, of 8) are the ones the ``amdgcn`` assembly states. NVIDIA: registers and spill
bytes from Triton's own ``ptxas --verbose`` on the kernel's PTX, and the occupancy computed from
them, the shared memory and the warps (65,536 registers, 228 KB of shared memory, 64 warps and 32
blocks per SM, registers allocated per warp in units of 256).

    python benchmarks/kernels/bench_kernel_resources.py                 # every config each target keeps
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared helpers in benchmarks/

from harness import RESULTS, command_line, write_results
from kernel_targets import DTYPES, compile_model_kernels, resources

from dlrmv4.ops.triton.targets import TARGETS, KernelTarget


def measure(target: KernelTarget) -> list[dict]:
    rows = []
    for v in compile_model_kernels(target, "all", DTYPES):
        facts = resources(v, target)
        rows.append(
            {
                "target": target.name,
                "gpus": target.gpus,
                "kernel": v.kernel,
                "dtype": v.dtype,
                "constants": {k: str(x) for k, x in v.constants},
                "config": v.describe(),
                "shared_memory": v.shared_memory,
                "shared_memory_limit": target.shared_memory,
                **facts,
            }
        )
    return rows


def _varying(rows: list[dict]) -> dict[str, list[str]]:
    """Per kernel, the non-tile constants that differ between its rows (what tells them apart)."""
    values: dict[str, dict[str, set]] = defaultdict(lambda: defaultdict(set))
    for r in rows:
        for k, x in r["constants"].items():
            values[r["kernel"]][k].add(x)
    return {
        kernel: sorted(k for k, xs in ks.items() if len(xs) > 1 and not k.startswith("BLOCK"))
        for kernel, ks in values.items()
    }


def table(rows: list[dict], dtype: str) -> str:
    varying = _varying(rows)
    lines = [
        "| kernel | variant | config | target | shared KB (of) | registers/lane | spills | occupancy |",
        "|---|---|---|---|---:|---:|---|---|",
    ]
    for r in sorted((r for r in rows if r["dtype"] == dtype), key=lambda r: (r["kernel"], r["config"], r["target"])):
        variant = ", ".join(f"{k}={r['constants'][k]}" for k in varying[r["kernel"]]) or "-"
        spills = f"**{r['spills']}**" if r["spilled"] else "none"
        lines.append(
            f"| {r['kernel']} | {variant} | {r['config']} | {r['target']} | "
            f"{r['shared_memory'] / 1024:.1f} ({r['shared_memory_limit'] / 1024:.0f}) | {r['registers']} | {spills} | "
            f"{r['occupancy']:.0%} ({r['occupancy_text']}) |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RESULTS), help="results folder")
    args = parser.parse_args()
    rows = [row for target in TARGETS for row in measure(target)]
    spilled = sorted({(r["kernel"], r["dtype"], r["target"]) for r in rows if r["spilled"]})
    text = (
        f"`{command_line()}`: every kernel variant the model launches (training step and eval, every "
        "recompute mode and last-layer choice, deterministic too), every config each target keeps, "
        "compiled on the CPU for each target. The table shows bf16, the benchmark's dtype; "
        "`kernel_resources.json` holds fp16 and fp32 too.\n\n"
        + table(rows, "bfloat16")
        + "\n\nSpills (any dtype): "
        + ("; ".join(f"{k} {d} on {t}" for k, d, t in spilled) or "none")
        + "."
    )
    print(text)
    write_results("kernel_resources", {"rows": rows}, text, device="cpu", out=Path(args.out))


if __name__ == "__main__":
    main()
