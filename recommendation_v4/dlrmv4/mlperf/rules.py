"""Compliance: the official checker on a run log, project rules for datasets other than
Yambda-5B, and the closed-division checks that refuse a run before it starts.

The official ``{closed,open}_dlrmv4.yaml`` pin Yambda-5B's constants (2,290,835,423 train samples,
2,058,204 eval samples, sequence 4,096, warm-up 24,000, the LR band, target 0.75), so a run on
any other dataset needs rules with that dataset's own numbers. ``write_dataset_rules`` writes
them as files the checker follows from ``--config <absolute path to main.yaml>``:

  main.yaml    BEGIN enqueues the official ``training_6.1.0/common.yaml``, then relay1.yaml;
  relay1.yaml  BEGIN enqueues relay2.yaml;
  relay2.yaml  BEGIN takes the official ``*_dlrmv4.yaml`` out of the queue and enqueues checks.yaml;
  checks.yaml  the keys of closed_dlrmv4.yaml with this dataset's train/eval samples, eval grid,
               first-eval point, sequence length, warm-up, batch size and target.

The checker works through a queue: common.yaml enqueues ``<division>_common.yaml``, which
enqueues ``<division>_dlrmv4.yaml``; the relays wait those two hops so that relay2 runs just
before the official benchmark file and replaces it. (Overriding its keys from a later file is
not enough: a failed at-least-one check, like the 0.75 target, cannot be overridden.) Every key
of common.yaml and ``<division>_common.yaml`` stays checked by the official files.

A closed-division run on Yambda-5B (``dataset.source = "yambda"``, ``dataset.size = "5b"``) must
log the pinned counts, and the log states the store's own counts: ``check_closed_division`` (before
the run) and ``check-log`` refuse it, naming both numbers, when the store's counts differ from
the pins (a store made by other preprocessing rules), so no log claims counts its data did not give.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from dlrmv4.config import BenchmarkConfig
from dlrmv4.errors import UserError
from dlrmv4.reference_counts import REFERENCE_EVAL_SAMPLES, REFERENCE_MAX_SEQ_LEN, REFERENCE_TRAIN_SAMPLES

RULESET = "6.1.0"

CHECKS = """\
- BEGIN:
    CODE: >
        s.update({{'train_samples': {train_samples}, 'eval_samples': {eval_samples},
                  'eval_interval_samples': {interval}, 'first_eval_samples': {first_eval},
                  'target_accuracy': {target}, 'opt_base_learning_rate': None}})

- KEY:
    NAME:  global_batch_size
    REQ:   EXACTLY_ONE
    CHECK: " is_integer(v['value']) and v['value'] == {global_batch_size} "

- KEY:
    NAME:  train_samples
    REQ:   EXACTLY_ONE
    CHECK: " v['value'] == s['train_samples'] "

- KEY:
    NAME:  eval_samples
    REQ:   EXACTLY_ONE
    CHECK: " v['value'] == s['eval_samples'] "

- KEY:
    NAME:  max_sequence_length
    REQ:   EXACTLY_ONE
    CHECK: " v['value'] == {max_seq_len} "

- KEY:
    NAME:  opt_name
    REQ:   EXACTLY_ONE
    CHECK: " v['value'] == 'Adam' "

- KEY:
    NAME:  opt_base_learning_rate
    REQ:   EXACTLY_ONE
    CHECK: " v['value'] > 0 "
    POST:  " s['opt_base_learning_rate'] = v['value'] "

- KEY:
    NAME:  opt_adam_beta_1
    REQ:   EXACTLY_ONE
    CHECK: " v['value'] == 0.95 "

- KEY:
    NAME:  opt_adam_beta_2
    REQ:   EXACTLY_ONE
    CHECK: " v['value'] == 0.999 "

- KEY:
    NAME:  opt_adam_epsilon
    REQ:   EXACTLY_ONE
    CHECK: " v['value'] == 1e-8 "

- KEY:
    NAME:  opt_weight_decay
    REQ:   EXACTLY_ONE
    CHECK: " v['value'] == 0.0 "

- KEY:
    NAME:  opt_gradient_clip_norm
    REQ:   EXACTLY_ONE
    CHECK: " v['value'] == 1.0 "

- KEY:
    NAME:  opt_sparse_name
    REQ:   EXACTLY_ONE
    CHECK: " v['value'] == 'RowWiseAdagrad' "

- KEY:
    NAME:  opt_sparse_base_learning_rate
    REQ:   EXACTLY_ONE
    CHECK: " v['value'] == {sparse_lr!r} "

- KEY:
    NAME:  opt_learning_rate_warmup_steps
    REQ:   EXACTLY_ONE
    CHECK: " v['value'] == {warmup_steps} "

- KEY:
    NAME:  opt_learning_rate_warmup_start_lr
    REQ:   EXACTLY_ONE
    CHECK: " v['value'] == 0.0 "

- KEY:
    NAME:  eval_every_data_pct
    REQ:   EXACTLY_ONE
    CHECK: " v['value'] == {eval_pct!r} "

- KEY:
    NAME:  eval_accuracy
    REQ:   AT_LEAST_ONE
    CHECK:
        - "'samples_count' in v['metadata']"
        - "v['metadata']['samples_count'] % s['eval_interval_samples'] == 0"
        - "0.0 <= v['value'] <= 1.0"
    FIRST_CHECK: " int(v['metadata']['samples_count']) == s['first_eval_samples'] "
    ATLEAST_ONE_CHECK: "v['value'] >= s['target_accuracy']"
"""


def is_reference_dataset(train_samples: int, eval_samples: int) -> bool:
    return (train_samples, eval_samples) == (REFERENCE_TRAIN_SAMPLES, REFERENCE_EVAL_SAMPLES)


def is_reference_config(cfg: BenchmarkConfig) -> bool:
    """The dataset the closed division pins: Yambda-5B."""
    return cfg.dataset.source == "yambda" and cfg.dataset.size == "5b"


def count_mismatches(train_samples: int, eval_samples: int) -> list[str]:
    """Each count that differs from the closed division's pin, naming both numbers."""
    return [
        f"{name} {got:,} from the store, the closed division pins {pinned:,}"
        for name, got, pinned in (
            ("train_samples", train_samples, REFERENCE_TRAIN_SAMPLES),
            ("eval_samples", eval_samples, REFERENCE_EVAL_SAMPLES),
        )
        if got != pinned
    ]


def check_reference_counts(cfg: BenchmarkConfig, train_samples: int, eval_samples: int) -> None:
    """Refuse a closed-division Yambda-5B run or log whose store's sample counts are not the pinned ones."""
    if cfg.mlperf.division != "closed" or not is_reference_config(cfg):
        return
    mismatches = count_mismatches(train_samples, eval_samples)
    if mismatches:
        raise UserError(
            f"the closed division refuses this Yambda-5B store: {'; '.join(mismatches)} (re-run the "
            "preprocessing with the reference's defaults: python -m dlrmv4 prepare --source yambda "
            "--size 5b, or download_dataset.sh --size 5b)"
        )


def write_dataset_rules(
    out_dir: Path,
    cfg: BenchmarkConfig,
    train_samples: int,
    eval_samples: int,
    interval: int,
    first_eval: int,
    world_size: int = 1,
) -> Path:
    """Write main/relay/checks.yaml for this dataset and config into ``out_dir``; returns main.yaml."""
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    checks, main = out_dir / "checks.yaml", out_dir / "main.yaml"
    relay1, relay2 = out_dir / "relay1.yaml", out_dir / "relay2.yaml"
    checks.write_text(
        CHECKS.format(
            train_samples=train_samples,
            eval_samples=eval_samples,
            interval=interval,
            first_eval=first_eval,
            target=cfg.train.target_auc,
            global_batch_size=cfg.loader.batch_size * world_size,
            max_seq_len=cfg.sampler.max_seq_len,
            warmup_steps=cfg.train.warmup_steps,
            sparse_lr=cfg.train.sparse_peak_lr,
            eval_pct=cfg.train.eval_every_data_pct,
        )
    )
    official = f"training_{RULESET}/"
    relay2.write_text(
        "- BEGIN:\n    CODE: >\n"
        "        queue = enqueue_config.__globals__['enqueued_configs'];\n"
        f"        queue[:] = [c for c in queue if not (c.startswith({official!r}) and c.endswith('_dlrmv4.yaml'))];\n"
        f"        enqueue_config({str(checks)!r})\n"
    )
    relay1.write_text(f'- BEGIN:\n    CODE: " enqueue_config({str(relay2)!r}) "\n')
    main.write_text(
        f"- BEGIN:\n    CODE: \" enqueue_config('{official}common.yaml'); enqueue_config({str(relay1)!r}) \"\n"
    )
    return main


def run_checker(log: Path, rules: Path | None = None) -> tuple[bool, str]:
    """The official compliance checker on ``log`` (its default rules, or ``rules``), warnings as errors (a
    repeated EXACTLY_ONE key with an equal value, like a second RUN_START, is only a warning otherwise):
    (passed, output)."""
    cmd = [
        sys.executable,
        "-m",
        "mlperf_logging.compliance_checker",
        str(log),
        "--usage",
        "training",
        "--ruleset",
        RULESET,
        "--werror",
        "--log_output",
        str(Path(log).with_suffix(".checker.txt")),
    ]
    if rules is not None:
        cmd += ["--config", str(Path(rules).resolve())]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    return proc.returncode == 0 and "SUCCESS" in output, output


def closed_division_problems(cfg: BenchmarkConfig, world_size: int = 1) -> list[str]:
    """What the closed division forbids in ``cfg`` (checked on the reference dataset)."""
    gbs = cfg.loader.batch_size * world_size
    lo, hi = 0.5e-6 * gbs / 8192, 1.5e-6 * gbs / 8192
    tr = cfg.train
    problems = []
    if not lo * (1 - 1e-9) <= tr.learning_rate <= hi * (1 + 1e-9):
        problems.append(
            f"learning rate {tr.learning_rate:g} is outside the closed band [{lo:.3g}, {hi:.3g}] "
            f"for global batch size {gbs}"
        )
    pinned = {
        "adam_beta1": 0.95,
        "adam_beta2": 0.999,
        "adam_eps": 1e-8,
        "weight_decay": 0.0,
        "grad_clip_norm": 1.0,
        "warmup_steps": 24_000,
        "eval_every_data_pct": 0.001,
    }
    if tr.sparse_peak_lr != tr.learning_rate:
        problems.append(
            f"train.sparse_learning_rate = {tr.sparse_learning_rate!r}, the closed division pins the dense learning "
            "rate (0)"
        )
    problems += [
        f"train.{name} = {getattr(tr, name)!r}, the closed division pins {value!r}"
        for name, value in pinned.items()
        if getattr(tr, name) != value
    ]
    if cfg.sampler.max_seq_len != REFERENCE_MAX_SEQ_LEN:
        problems.append(f"sampler.max_seq_len = {cfg.sampler.max_seq_len}, the closed division pins 4096")
    return problems


def check_closed_division(cfg: BenchmarkConfig, train_samples: int, eval_samples: int, world_size: int = 1) -> None:
    """Refuse a closed-division run on the reference dataset (Yambda-5B) whose store's sample counts
    differ from the pins or whose settings the rules forbid; other datasets follow the project rules."""
    if cfg.mlperf.division != "closed" or not is_reference_config(cfg):
        return
    check_reference_counts(cfg, train_samples, eval_samples)
    problems = closed_division_problems(cfg, world_size)
    if problems:
        raise UserError(
            f"the closed division forbids this run: {problems[0]}"
            + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
            + "; only the learning rate (inside the band) and the batch size may change"
        )


def run_seconds(log: Path) -> tuple[float, float]:
    """(RUN_START time in s since the epoch, RUN_STOP - RUN_START in s) from a run log."""
    import json

    times = {}
    for line in Path(log).read_text().splitlines():
        if line.startswith(":::MLLOG "):
            record = json.loads(line[len(":::MLLOG ") :])
            if record["key"] in ("run_start", "run_stop"):
                times[record["key"]] = record["time_ms"] / 1e3
    if set(times) != {"run_start", "run_stop"}:
        raise UserError(f"{log} has no complete run (RUN_START and RUN_STOP)")
    return times["run_start"], times["run_stop"] - times["run_start"]
