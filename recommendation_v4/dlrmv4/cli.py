"""Command line: ``python -m dlrmv4 <command> [--preset NAME] [--config FILE] [--<field> VALUE ...]``.

Every failure the user can fix is one line on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable, NoReturn

from dlrmv4.config import BenchmarkConfig
from dlrmv4.config_loading import add_config_arguments, config_from_args, list_presets, to_toml
from dlrmv4.distributed.launcher_parent import STOP_WAIT_SECONDS, LauncherParent
from dlrmv4.distributed.liveness import RankLostError
from dlrmv4.errors import ERROR_PREFIX, UserError, report_failure, under_launcher
from dlrmv4.files import remove_dead_temps
from dlrmv4.slurm_tasks import adopt_slurm_tasks


def _say(msg: str) -> None:
    print(f"[dlrmv4] {msg}", flush=True)


def _show_progress(args: argparse.Namespace) -> bool:
    """Bars only on a terminal: redirected to a file, their carriage-return redraws would fill the log."""
    return not args.no_progress and sys.stderr.isatty()


def _raw_files(cfg: BenchmarkConfig, progress: bool):
    """The raw parquet of the configured source: generated once, or fetched from the hub."""
    from dlrmv4.data.paths import synthetic_raw_root
    from dlrmv4.data.yambda_schema import RawFiles

    ds = cfg.dataset
    if ds.source == "synthetic":
        root = synthetic_raw_root(ds)
        files = RawFiles.under(root, ds.size)
        for folder in {p.parent for p in files.all()}:
            remove_dead_temps(folder, _say)
        if all(p.exists() for p in files.all()):
            _say(f"synthetic raw data already at {root}")
        else:
            from dlrmv4.data.synthetic import generate

            _say(f"generating synthetic Yambda-schema data ({ds.size}, seed {ds.synthetic_seed}) into {root}")
            files = generate(root, ds.size, ds.synthetic_seed, progress=progress)
        return files, None
    from dlrmv4.data.download import download_yambda

    _say(f"downloading {ds.hub_repo_id} flat/{ds.size} at revision {ds.hub_revision}")
    return download_yambda(ds, progress=progress)


def cmd_download(cfg: BenchmarkConfig, args: argparse.Namespace) -> None:
    files, revision = _raw_files(cfg, _show_progress(args))
    for p in files.all():
        _say(f"raw file {p}")
    if revision:
        _say(f"resolved revision {revision}")


def cmd_preprocess(cfg: BenchmarkConfig, args: argparse.Namespace) -> None:
    from dlrmv4.data.paths import store_dir
    from dlrmv4.data.preprocess import preprocess

    files, revision = _raw_files(cfg, _show_progress(args))
    out = store_dir(cfg.dataset)
    remove_dead_temps(out.parent, _say)
    _say(f"preprocessing into {out}")
    truth = None
    if cfg.dataset.source == "synthetic":
        from dlrmv4.data.synthetic import truth_path

        truth = truth_path(files)
    meta = preprocess(
        files,
        out,
        cfg.dataset,
        cfg.preprocess,
        resolved_revision=revision,
        progress=_show_progress(args),
        truth=truth,
    )
    c = meta["counts"]
    n = meta["split"]["num_windows"]
    _say(
        f"store ready: {c['train_events']:,} train events of {c['train_users']:,} users, "
        f"{c['test_events']:,} test events, {c['anchors']:,} anchors in {n} windows ({c['train_samples']:,} in the "
        f"train windows 0..{max(n - 2, 0)}, {c['eval_samples']:,} in the holdout window {max(n - 1, 0)}), "
        f"{c['num_items']:,} items ({meta['seconds']:.1f} s, "
        f"{c['raw_events'] / max(meta['seconds'], 1e-9) / 1e6:.2f} M raw events/s)"
    )
    from dlrmv4.data.holdout_quality import describe_quality

    _say(f"{describe_quality(meta)} ({meta['quality_seconds']:.1f} s)")
    if c["dropped_null_ratio_listens"]:
        _say(f"dropped {c['dropped_null_ratio_listens']:,} listens with a null played_ratio_pct")
    elif c["null_ratio_listens"]:
        _say(f"kept {c['null_ratio_listens']:,} listens with a null played_ratio_pct as skips (ratio 0, label 0)")


def _discover_store(data_path: Path) -> Path:
    """The one processed store under ``data_path`` (what download_dataset.sh wrote there)."""
    root = data_path / "processed"
    stores = sorted(p for p in root.iterdir() if (p / "meta.json").exists()) if root.is_dir() else []
    if not stores:
        raise UserError(f"no processed store under {root} (run download_dataset.sh with --data-path {data_path})")
    if len(stores) > 1:
        raise UserError(
            f"{len(stores)} processed stores under {root}: {', '.join(p.name for p in stores)}; name one "
            "with --size (and --source synthetic) or --store"
        )
    return stores[0]


def _store_dataset_name(path: Path, fallback: str) -> str:
    """<source>-<size> as the store's meta.json records it (the published sums are keyed by it)."""
    import json

    try:
        dataset = json.loads((path / "meta.json").read_text())["dataset"]
        return f"{dataset['source']}-{dataset['size']}"
    except (OSError, ValueError, KeyError, TypeError):
        return fallback


def cmd_verify(cfg: BenchmarkConfig, args: argparse.Namespace) -> None:
    from dlrmv4.data.paths import store_dir
    from dlrmv4.data.verify import check_reference_md5s, read_reference_md5s, verify_and_stamp

    if getattr(args, "discover", False):
        path = _discover_store(Path(cfg.dataset.data_path))
    else:
        path = Path(args.store) if getattr(args, "store", None) else store_dir(cfg.dataset)
    name = _store_dataset_name(path, cfg.dataset.name)
    problems = verify_and_stamp(path, progress=_show_progress(args), on_step=_say)
    reference_file = getattr(args, "reference_md5s", None)
    if not problems and reference_file:
        reference = read_reference_md5s(Path(reference_file), name)
        if reference:
            problems = check_reference_md5s(path, reference)
            if not problems:
                _say(f"all {len(reference)} files match the published sums for {name} in {reference_file}")
        else:
            _say(f"no published sums for {name} in {reference_file} (see docs/data.md: Checksums)")
    if problems:
        for p in problems[1:]:
            print(f"[dlrmv4]   also: {p}", file=sys.stderr)
        raise UserError(f"verification failed: {problems[0]}")
    _say(f"verified {path}: md5 sums and store invariants OK")
    from dlrmv4.data.holdout_quality import describe_quality
    from dlrmv4.data.store import read_meta

    _say(describe_quality(read_meta(path)))


def _store_current(cfg: BenchmarkConfig, say: Callable[[str], None] = _say) -> bool:
    """True when the configured store exists and was written by this code's store schema (an older
    one is rebuilt: the preprocessing's rules changed with its schema, and ``say`` says so); one built
    with other settings than ``cfg``'s is refused in one line."""
    import json

    from dlrmv4.data.paths import store_dir
    from dlrmv4.data.store import META_FILE, STORE_SCHEMA_VERSION

    meta = store_dir(cfg.dataset) / META_FILE
    if not meta.exists():
        return False
    try:
        version = json.loads(meta.read_text()).get("schema_version")
    except (OSError, ValueError):
        version = None
    if version != STORE_SCHEMA_VERSION:
        say(
            f"the store at {meta.parent} has schema version {version}, this code writes {STORE_SCHEMA_VERSION}: "
            "rebuilding it"
        )
        return False
    from dlrmv4.data.store_settings import check_store_settings

    check_store_settings(meta.parent, json.loads(meta.read_text()), cfg)
    return True


def cmd_prepare(cfg: BenchmarkConfig, args: argparse.Namespace) -> None:
    prepare_store(cfg, args, if_missing=getattr(args, "if_missing", False))


def prepare_store(cfg: BenchmarkConfig, args: argparse.Namespace, if_missing: bool) -> None:
    """Download, preprocess and verify the store (``if_missing``: only where it is not there, current
    and verified), holding the store's prepare lock: a second preparation of the same store waits
    for the first, saying so, and then uses the store the first one left."""
    from dlrmv4.data.paths import store_dir
    from dlrmv4.data.prepare_lock import PrepareLock

    # A ready store needs no lock (its data path may be read-only); a missing one is checked again
    # under the lock, where a preparation that just ended may have left it.
    if if_missing and _store_current(cfg, say=lambda _: None):
        _use_current_store(cfg, args)
        return
    with PrepareLock(store_dir(cfg.dataset), _say) as lock:
        if (if_missing or lock.waited) and _store_current(cfg):
            _use_current_store(cfg, args)
            return
        cmd_preprocess(cfg, args)
        cmd_verify(cfg, args)


def _use_current_store(cfg: BenchmarkConfig, args: argparse.Namespace) -> None:
    """A current store: ready if verified, else verified now."""
    from dlrmv4.data.paths import store_dir
    from dlrmv4.data.verified_stamp import unverified_reason

    reason = unverified_reason(store_dir(cfg.dataset))
    if reason is None:
        _say(f"store ready at {store_dir(cfg.dataset)}: nothing to prepare")
        return
    _say(f"the store at {store_dir(cfg.dataset)} {reason}: verifying it")
    cmd_verify(cfg, args)


def cmd_sample(cfg: BenchmarkConfig, args: argparse.Namespace) -> None:
    from dlrmv4.data.loader import make_window_loader
    from dlrmv4.data.paths import store_dir
    from dlrmv4.data.store import open_store

    store = open_store(store_dir(cfg.dataset))
    windows = [w for w in range(store.num_windows) if store.window_offsets[w + 1] > store.window_offsets[w]]
    if not windows:
        raise UserError(f"{store.path}: no anchors in any window (min_history too large for this data?)")
    window = windows[0]
    loader = make_window_loader(store, [window], cfg)
    started = time.perf_counter()
    samples = 0
    for i, batch in enumerate(loader):
        if i >= args.batches:
            break
        samples += batch.num_samples
        _say(
            f"window {window} batch {i}: {batch.num_samples} samples, {batch.total_tokens:,} history tokens "
            f"(max {batch.max_history_length}, mean {batch.total_tokens / batch.num_samples:.0f}), "
            f"label mean {float(batch.label.float().mean()):.3f}"
        )
    seconds = time.perf_counter() - started
    _say(f"assembled {samples} samples in {seconds:.2f} s with {cfg.loader.num_workers} workers")


def cmd_pipeline(cfg: BenchmarkConfig, args: argparse.Namespace) -> None:
    cmd_prepare(cfg, args)
    cmd_sample(cfg, args)


def cmd_train(cfg: BenchmarkConfig, args: argparse.Namespace) -> None:
    from dlrmv4.train.run import run_training

    # Under a multi-process launcher the data is prepared once beforehand (run_and_time.sh does it).
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 and not _store_current(cfg, say=lambda _: None):
        prepare_store(cfg, args, if_missing=True)  # says why it prepares
    config_filename = Path(args.config).name if args.config else f"{args.preset or 'defaults'}.toml"
    history, report = run_training(
        cfg, log=_say, progress=_show_progress(args), restart=args.restart, config_filename=config_filename
    )
    if os.environ.get("RANK", "0") != "0":
        return  # rank 0 speaks for the run
    best = max((e.auc for e in history.evals), default=float("nan"))
    _say(
        f"run {history.status}: {history.steps:,} steps, {history.samples:,} samples, {len(history.evals)} evals, "
        f"best AUC {best:.4f} (target {cfg.train.target_auc}); {_checkpoint_cost(history)}; report {report}"
    )


def _checkpoint_cost(history) -> str:
    """What checkpoints cost the timed run: the steps' waits for them, against the run's seconds."""
    share = history.checkpoint_seconds / history.seconds if history.seconds > 0 else 0.0
    skipped = (
        f", {history.checkpoints_skipped} skipped while one was being written" if history.checkpoints_skipped else ""
    )
    return f"checkpoints {history.checkpoint_seconds:.1f} s of the run's {history.seconds:.1f} s ({share:.1%}){skipped}"


def cmd_plan(cfg: BenchmarkConfig, args: argparse.Namespace) -> None:
    from dlrmv4.plan.explain import describe, refusal
    from dlrmv4.plan.machine import plan_for_config

    plan = plan_for_config(cfg)
    print(describe(plan), flush=True)
    if not plan.fits:
        raise UserError(refusal(plan))


def _dataset_rules(cfg: BenchmarkConfig, folder: Path) -> Path | None:
    """The compliance checker's rules for the run's dataset, written under ``folder``: None (the
    official closed rules) for Yambda-5B, the project's rules for any other store."""
    from dlrmv4.data.paths import store_dir
    from dlrmv4.data.store import open_store
    from dlrmv4.data.windows import sample_counts
    from dlrmv4.mlperf.rules import check_reference_counts, is_reference_dataset, write_dataset_rules
    from dlrmv4.train.schedule import EvalSchedule

    train_samples, eval_samples = sample_counts(open_store(store_dir(cfg.dataset)))
    # Closed Yambda-5B: the official rules pin the counts; a store that gives others is refused here.
    check_reference_counts(cfg, train_samples, eval_samples)
    if is_reference_dataset(train_samples, eval_samples):
        return None
    schedule = EvalSchedule(train_samples, cfg.loader.batch_size, cfg.train.eval_every_data_pct)
    return write_dataset_rules(folder, cfg, train_samples, eval_samples, schedule.interval, schedule.first)


def cmd_check_log(cfg: BenchmarkConfig, args: argparse.Namespace) -> None:
    import getpass

    from dlrmv4.mlperf.rules import RULESET, run_checker, run_seconds
    from dlrmv4.train.run import run_log_path

    log = Path(args.log) if args.log else run_log_path(cfg)
    if not log.is_file():
        raise UserError(f"no MLPerf run log at {log} (train first, or pass --log)")
    rules = _dataset_rules(cfg, log.parent / "mlperf_rules")
    passed, output = run_checker(log, rules)
    which = "the official closed_dlrmv4 rules" if rules is None else f"the project rules for this dataset ({rules})"
    if not passed:
        print(output.strip()[-4000:], file=sys.stderr)
        raise UserError(f"{log} FAILED the MLPerf compliance checker (training {RULESET}, {which})")
    _say(f"{log} PASSED the MLPerf compliance checker (training {RULESET}, {which})")
    started, seconds = run_seconds(log)
    print(
        f"RESULT,dlrmv4,{cfg.seed},{seconds:.0f},{getpass.getuser()},"
        f"{time.strftime('%Y-%m-%d %I:%M:%S %p', time.localtime(started))}",
        flush=True,
    )


def cmd_score(cfg: BenchmarkConfig, args: argparse.Namespace) -> None:
    import tempfile

    from dlrmv4.mlperf.rcp_band import RCP_DIR, rcp_file
    from dlrmv4.mlperf.score import describe, score_set

    folder = Path(args.folder)
    if not folder.is_dir():
        raise UserError(f"{folder} is not a folder of result_<i>.txt logs")
    with tempfile.TemporaryDirectory(prefix="dlrmv4-rules-") as scratch:
        rules = _dataset_rules(cfg, Path(scratch))
        rcps = Path(args.rcps) if args.rcps else None
        if rcps is None and rules is not None:  # a synthetic store: the project's RCPs for its preset
            rcps = rcp_file(cfg)
            if not rcps.is_file():
                raise UserError(f"no RCPs for {cfg.dataset.name} in {RCP_DIR}: pass --rcps FILE")
        if rcps is not None and not rcps.is_file():
            raise UserError(f"no RCP file at {rcps}")
        result = score_set(folder, rules, rcps)
    print(describe(result, folder), flush=True)
    for note in result.notes:
        if note.startswith(("WARNING", "CRITICAL", "ERROR", "NOTICE")):
            _say(note)
    failed = [f"{r.file} {r.problem}" for r in result.runs if r.problem]
    if not result.seeds_distinct:
        raise UserError(f"{folder}: the seed checker failed (two runs log the same seed from the same line)")
    if not result.rcp_passed:
        raise UserError(f"{folder}: the RCP check failed ({result.rcp_message})")
    if result.score_minutes is None:
        raise UserError(f"{folder}: no score, too many runs dropped: {'; '.join(failed)}")


def nodes_of_the_job() -> int:
    """The job's node count as the launcher (NNODES) or SLURM (SLURM_NNODES) gives it; 1 without either."""
    for name in ("NNODES", "SLURM_NNODES"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def cmd_system_desc(cfg: BenchmarkConfig, args: argparse.Namespace) -> None:
    from dlrmv4.mlperf.system_desc import describe, write_system_desc

    if not args.name or "/" in args.name or args.name.startswith("."):
        raise UserError(f"the system's name must be a plain file name, got {args.name!r}")
    directory = Path(args.systems_dir) if args.systems_dir else Path(cfg.train.run_dir) / "systems"
    report = write_system_desc(directory, args.name, args.nodes or nodes_of_the_job(), Path(cfg.train.run_dir))
    for line in describe(report):
        _say(line)
    if not report.checker_passed:
        raise UserError(f"{report.path} does not pass system_desc_checker yet: fill the fields named above")


def cmd_merge_traces(cfg: BenchmarkConfig, args: argparse.Namespace) -> None:
    from dlrmv4.train.trace import TRACE_DIR, merge_traces

    trace_dir = Path(args.traces) if args.traces else Path(cfg.train.run_dir) / TRACE_DIR
    for path in merge_traces(trace_dir):
        _say(f"merged trace {path} (open it in ui.perfetto.dev or chrome://tracing)")


def cmd_show_config(cfg: BenchmarkConfig, args: argparse.Namespace) -> None:
    print(to_toml(cfg), end="")


COMMANDS: dict[str, tuple[Callable[[BenchmarkConfig, argparse.Namespace], None], str]] = {
    "download": (cmd_download, "fetch (yambda) or generate (synthetic) the raw parquet"),
    "preprocess": (cmd_preprocess, "raw parquet -> processed store (downloads first if needed)"),
    "verify": (cmd_verify, "check a store's md5 sums and invariants"),
    "prepare": (cmd_prepare, "download + preprocess + verify (what download_dataset.sh runs)"),
    "sample": (cmd_sample, "assemble a few jagged batches from the first window and print them"),
    "pipeline": (cmd_pipeline, "prepare + sample: the data path end to end"),
    "train": (cmd_train, "the benchmark: prepare the data if needed, then train to the target AUC"),
    "plan": (
        cmd_plan,
        "print the memory plan of a run (--plan-world-size, --plan-device-memory-gib, ...); exit 1 "
        "when it does not fit",
    ),
    "merge-traces": (
        cmd_merge_traces,
        "merge the per-rank profiler traces of train.profile_steps into one file per window",
    ),
    "check-log": (cmd_check_log, "run the official MLPerf compliance checker on a run's log; print RESULT"),
    "score": (
        cmd_score,
        "check and score a set of runs' logs (result_<i>.txt) as MLPerf does: compliance, seeds, RCPs, olympic mean",
    ),
    "system-desc": (
        cmd_system_desc,
        "draft systems/<NAME>.json from this machine (an existing one is kept) and run system_desc_checker on it",
    ),
    "show-config": (cmd_show_config, "print the resolved configuration as TOML"),
}


class OneLineParser(argparse.ArgumentParser):
    """A bad flag or value gets one line and a pointer to --help, not the usage block (exit 2, as
    argparse's own). Its subcommands' parsers are of this class too (argparse makes them so)."""

    def error(self, message: str) -> NoReturn:
        print(f"{ERROR_PREFIX}{message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="dlrmv4", description="DLRMv4 HSTU benchmark")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_config_arguments(p)
        p.add_argument(
            "--no-progress",
            action="store_true",
            help="no progress bars (they are off anyway when stderr is not a terminal)",
        )
        if name in ("verify", "prepare", "pipeline", "train"):
            p.add_argument(
                "--reference-md5s",
                default=None,
                help="published checksum file (the repository's md5sums) to compare the store with",
            )
        if name == "prepare":
            p.add_argument("--if-missing", action="store_true", help="do nothing when the store already exists")
        if name == "verify":
            p.add_argument("--store", default=None, help="store directory (default: from the dataset config)")
            p.add_argument(
                "--discover",
                action="store_true",
                help="verify the one store under --data-path/processed (several: name one)",
            )
        if name == "train":
            p.add_argument(
                "--restart",
                action="store_true",
                help="start cold: delete run_dir's checkpoints and report instead of resuming",
            )
        if name == "merge-traces":
            p.add_argument("--traces", default=None, help="trace folder (default: <run_dir>/traces)")
        if name == "check-log":
            p.add_argument(
                "--log", default=None, help="the run log (default: mlperf.log_file or <run_dir>/mlperf_log.txt)"
            )
        if name == "score":
            p.add_argument("folder", help="the folder of the set's MLPerf logs, result_<i>.txt")
            p.add_argument(
                "--rcps",
                default=None,
                help="RCP file (default: mlperf-logging's for Yambda-5B, rcp/rcps_dlrmv4_<preset>.json for a synthetic store)",
            )
        if name == "system-desc":
            p.add_argument("name", help="the system's name: the file is <systems-dir>/<name>.json")
            p.add_argument("--systems-dir", default=None, help="where it goes (default: <run_dir>/systems)")
            p.add_argument(
                "--nodes", type=int, default=0, help="nodes of the system (default: NNODES, SLURM_NNODES or 1)"
            )
        if name in ("sample", "pipeline"):
            p.add_argument("--batches", type=int, default=3, help="batches to assemble")
    return parser


def _preset_from_dataset_flags(args: argparse.Namespace, argv: list[str]) -> None:
    """``--source yambda --size 5b`` without ``--preset`` selects the ``yambda-5b`` preset."""
    if "--preset" in argv or any(a.startswith("--preset=") for a in argv):
        return
    source = getattr(args, "cfg__dataset__source", None)
    size = getattr(args, "cfg__dataset__size", None)
    if source or size:
        name = f"{source or 'synthetic'}-{size or 'tiny'}"
        if name in list_presets():
            args.preset = name


class Terminated(KeyboardInterrupt):
    """SIGTERM (a batch scheduler's time limit, run_and_time.sh passing one on): the run ends as it
    does on SIGINT (temp files removed, checkpoints whole), with its own line and status."""


class TerminationSignal:
    """SIGTERM's handler: raises ``Terminated`` and remembers that it ran. The exception can be lost:
    raised while the autograd engine runs a collective's backward that then fails (the peer, stopped
    by the same scheduler, has gone), the engine re-raises the collective's error, not the handler's.

    torchrun stops a rank, and a scheduler a job, by signalling the whole process group: the loader's
    workers die of the same SIGTERM, and torch's SIGCHLD handler would raise 'DataLoader worker ...
    killed by signal' anywhere in the unwinding. Stopping, this process no longer listens for that."""

    def __init__(self) -> None:
        self.received = False

    def __call__(self, signum: int, frame: object) -> None:
        if self.received:  # a second one (a launcher's death signal comes once per thread of it) changes nothing
            return
        self.received = True
        # A handler that does nothing, not SIG_DFL: a SIGCHLD already pending would raise OSError then.
        signal.signal(signal.SIGCHLD, _ignore_signal)
        raise Terminated()


def _ignore_signal(signum: int, frame: object) -> None:
    return None


# A launcher stopping the job sends every rank its SIGTERM at once; a rank in a collective may see the
# peer that stopped first leave before its own signal is handled.
LAUNCHER_STOP_GRACE_SECONDS = 1.0


def _ended_by_sigterm(exc: UserError, sigterm: TerminationSignal) -> bool:
    """Whether ``exc`` is a collective that lost a rank that left no line because the job is being
    stopped: this rank's own SIGTERM came (its ``Terminated`` lost on the way), or, under a launcher,
    follows within the grace (the launcher then says the job's line)."""
    if not (isinstance(exc, RankLostError) and not exc.peer_said_why):
        return False
    if sigterm.received:
        return True
    if not under_launcher():
        return False
    try:
        time.sleep(LAUNCHER_STOP_GRACE_SECONDS)
    except Terminated:
        return True
    return False


def _say_terminated() -> int:
    if not under_launcher():  # dlrmv4.launch says the job's one line about the stop
        print("[dlrmv4] terminated (SIGTERM)", file=sys.stderr)
    return 143


def _say_orphaned(launcher: LauncherParent) -> int:
    """No launcher is left to say the job's line: this rank says its own, in one write (ranks share a console)."""
    sys.stderr.flush()
    os.write(sys.stderr.fileno(), f"{ERROR_PREFIX}{launcher.line()}\n".encode())  # one write: atomic on a pipe
    return 1


def _failure_status(exc: BaseException, sigterm: TerminationSignal) -> int:
    """The exit status of a run that ``exc`` ended, after its one line; raises what no line covers."""
    if isinstance(exc, UserError):
        if _ended_by_sigterm(exc, sigterm):
            return _say_terminated()
        report_failure(str(exc), exc.caused_by_another_rank)
        return 1
    if isinstance(exc, OSError):  # an I/O failure no step turned into its own line: the file and the cause
        where = f"{exc.filename}: " if exc.filename else ""
        report_failure(f"{where}{exc.strerror or ' '.join(str(exc).split())}")
        return 1
    if isinstance(exc, Terminated):
        return _say_terminated()
    if isinstance(exc, KeyboardInterrupt):
        if not under_launcher():  # dlrmv4.launch says the job's one line about the stop
            print("[dlrmv4] interrupted", file=sys.stderr)
        return 130
    if sigterm.received:  # whatever failed once SIGTERM came failed because the run was being stopped
        return _say_terminated()
    raise exc


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    sigterm = TerminationSignal()
    signal.signal(signal.SIGTERM, sigterm)
    launcher = LauncherParent.follow()
    if launcher.gone():  # it died while this rank started
        return _say_orphaned(launcher)
    try:
        adopt_slurm_tasks()  # an srun task of several is one rank: the names torch reads, before anything reads them
        _preset_from_dataset_flags(args, argv)
        cfg = config_from_args(args)
        COMMANDS[args.command][0](cfg, args)
    except BaseException as exc:
        # The launcher's loss is the cause, whatever failed after it.
        if launcher.gone(STOP_WAIT_SECONDS):
            return _say_orphaned(launcher)
        return _failure_status(exc, sigterm)
    return 0
