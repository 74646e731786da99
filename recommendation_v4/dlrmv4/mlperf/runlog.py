"""The MLPerf run log (docs/mlperf.md): ``:::MLLOG`` lines written through ``mlperf_logging.mllog``.

Resume-aware: a cold start truncates the file; every checkpoint records the log's length in lines
(and bytes) and the sha256 of those bytes, and a resumed run checks them and cuts the file back to
it before appending, so the events of the
steps after the checkpoint (which the resumed run repeats) appear once, and the file holds exactly
one INIT_START and one RUN_START. A resume whose hyperparameters differ from the logged ones
(``--allow-changed-settings``, another world size's chunks) rewrites their values in place, so the
log states what is in force, and appends a ``resumed_with_changed_settings`` event naming the
changed settings. Each event is one whole line written at once; a write that fails is cut back off
and ends the run in one line naming the file. Only rank 0 writes; ``barrier`` runs on every rank
before INIT_STOP, RUN_START and RUN_STOP.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from mlperf_logging.mllog import constants as C
from mlperf_logging.mllog.mllog import MLLogger

from dlrmv4.config import BenchmarkConfig
from dlrmv4.errors import UserError
from dlrmv4.files import write_atomically, write_errors_in_one_line

PACKAGE_ROOT = Path(__file__).resolve().parents[2]
PRECISION = {"bfloat16": "bfloat16", "float16": "fp16", "float32": "fp32"}
COMM_PRECISION = {"none": "fp32", "fp16": "fp16", "bf16": "bfloat16"}


@dataclass(frozen=True)
class RunFacts:
    """What the log states about the run beyond its config."""

    train_samples: int
    eval_samples: int
    config_filename: str
    world_size: int = 1
    chunks: int = 1  # dense forward/backward passes per optimizer step (train/chunks.py)


class RunLog:
    def __init__(self, path: Path, rank: int = 0, barrier: Callable[[], None] = lambda: None) -> None:
        self.path = Path(path)
        self.writer = rank == 0
        self.barrier = barrier
        self._handler: _WholeLineHandler | None = None
        self._mllog: MLLogger | None = None
        self.block_open = False

    # -- file ----------------------------------------------------------------------------
    @staticmethod
    def check_writable(path: Path) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a"):
                pass
        except OSError as exc:
            raise UserError(f"MLPerf log file {path} is not writable: {exc.strerror or exc}") from exc

    def open(
        self,
        keep_bytes: int = 0,
        keep_lines: int | None = None,
        values: dict[str, Any] | None = None,
        kept_sha256: str | None = None,
    ) -> None:
        """Cut the file to its first ``keep_lines`` lines (else ``keep_bytes``; 0: a cold start),
        with the events of ``values``' keys given those values, and append from there. A kept part
        whose sha256 is not ``kept_sha256`` (when given) is refused: the log was edited since."""
        if not self.writer:
            return
        self.check_writable(self.path)
        size = self.path.stat().st_size
        data = self.path.read_bytes() if keep_lines is not None or values or kept_sha256 else b""
        if keep_lines is not None:
            lines = data.splitlines(keepends=True)
            if keep_lines > len(lines):
                raise UserError(
                    f"MLPerf log {self.path} is shorter ({len(lines)} lines) than the checkpoint recorded "
                    f"({keep_lines}): it was replaced or truncated, so this run cannot continue it"
                )
            keep_bytes = sum(len(line) for line in lines[:keep_lines])
        if keep_bytes > size:
            raise UserError(
                f"MLPerf log {self.path} is shorter ({size} bytes) than the checkpoint recorded "
                f"({keep_bytes}): it was replaced or truncated, so this run cannot continue it"
            )
        if kept_sha256 is not None and hashlib.sha256(data[:keep_bytes]).hexdigest() != kept_sha256:
            raise UserError(
                f"MLPerf log {self.path} differs from what the checkpoint recorded of its first "
                f"{keep_lines if keep_lines is not None else keep_bytes} {'lines' if keep_lines is not None else 'bytes'}: "
                "it was edited or replaced, so this run cannot continue it (put the run's own log back, "
                "or start over with --restart)"
            )
        kept = b"".join(_with_values(line, values or {}) for line in data[:keep_bytes].splitlines(keepends=True))
        if values and kept != data[:keep_bytes]:  # shorter or longer: the checkpoints count lines
            write_atomically(self.path, lambda tmp: tmp.write_bytes(kept))
        else:
            with open(self.path, "r+b") as fh:
                fh.truncate(keep_bytes)
                fh.flush()
                os.fsync(fh.fileno())
        logger = logging.Logger(f"dlrmv4.mllog.{self.path}")  # not registered: no global logger state
        self._handler = _WholeLineHandler(self.path)
        self._handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(self._handler)
        logger.setLevel(logging.INFO)
        # Caller file names relative to the package root: no machine's paths in the log.
        self._mllog = MLLogger(logger=logger, default_stack_offset=2, root_dir=re.escape(str(PACKAGE_ROOT)))

    @property
    def opened(self) -> bool:
        return self._mllog is not None or not self.writer

    def state(self) -> dict[str, Any]:
        """What a checkpoint records of the log: its length in bytes and lines and the sha256 of those
        bytes (a resume refuses a log that differs), and whether a block is open."""
        data = self.path.read_bytes() if self.writer and self.path.exists() else b""
        return {
            "bytes": len(data),
            "lines": data.count(b"\n"),
            "sha256": hashlib.sha256(data).hexdigest(),
            "block_open": self.block_open,
        }

    def resume(
        self, state: dict[str, Any], cfg: BenchmarkConfig, facts: RunFacts, changed_settings: Sequence[str] = ()
    ) -> None:
        """Continue the log from a checkpoint's ``state``: cut back to it, the hyperparameters
        rewritten to those in force (``cfg``, ``facts``), and the contract's changed settings that
        ``--allow-changed-settings`` let through recorded."""
        lines = state.get("lines")  # checkpoints before lines were counted hold bytes only
        self.open(
            int(state["bytes"]), None if lines is None else int(lines), hyperparameters(cfg, facts), state.get("sha256")
        )
        self.block_open = bool(state["block_open"])
        if changed_settings:
            self.event("resumed_with_changed_settings", "; ".join(changed_settings))

    def close(self) -> None:
        if self._handler is not None:
            with write_errors_in_one_line(self.path):
                self._handler.close()
            self._handler = None

    # -- events --------------------------------------------------------------------------
    def event(self, key: str, value: Any = None, metadata: dict | None = None) -> None:
        self._log("event", key, value, metadata)

    def start(self, key: str, value: Any = None, metadata: dict | None = None) -> None:
        self._log("start", key, value, metadata)

    def end(self, key: str, value: Any = None, metadata: dict | None = None) -> None:
        self._log("end", key, value, metadata)

    def _log(self, kind: str, key: str, value: Any, metadata: dict | None) -> None:
        if self._mllog is None or self._handler is None:
            return
        with write_errors_in_one_line(self.path):
            getattr(self._mllog, kind)(key=key, value=value, metadata=metadata, stack_offset=3)
            if self._handler.error is not None:  # mllog may have swallowed it
                raise self._handler.error

    # -- the benchmark's events, in docs/mlperf.md's order ---------------------------------------
    def init_start(self) -> None:
        self.event(C.CACHE_CLEAR, True)
        self.start(C.INIT_START)

    def init_stop_and_run_start(self, cfg: BenchmarkConfig, facts: RunFacts) -> None:
        for key, value in hyperparameters(cfg, facts).items():
            self.event(key, value)
        self.barrier()
        self.end(C.INIT_STOP)
        self.barrier()
        self.start(C.RUN_START)
        self.event(C.TRAIN_SAMPLES, facts.train_samples)
        self.event(C.EVAL_SAMPLES, facts.eval_samples)
        self.block_start(0, facts.train_samples)

    def block_start(self, samples: int, train_samples: int) -> None:
        self.start(C.BLOCK_START, metadata={C.SAMPLES_COUNT: samples, "epoch_num": samples / train_samples})
        self.block_open = True

    def block_stop(self, samples: int, train_samples: int) -> None:
        if self.block_open:
            self.end(C.BLOCK_STOP, metadata={C.SAMPLES_COUNT: samples, "epoch_num": samples / train_samples})
            self.block_open = False

    def evaluation(self, samples: int, train_samples: int, auc: Callable[[], float]) -> float:
        """EVAL_START, the eval itself, EVAL_ACCURACY, EVAL_STOP; returns the AUC."""
        meta = {C.SAMPLES_COUNT: samples, "epoch_num": samples / train_samples}
        self.block_stop(samples, train_samples)
        self.start(C.EVAL_START, metadata=meta)
        value = auc()
        self.event(C.EVAL_ACCURACY, value, metadata=meta)
        self.end(C.EVAL_STOP, metadata=meta)
        return value

    def run_stop(self, samples: int, train_samples: int, status: str) -> None:
        self.block_stop(samples, train_samples)
        self.barrier()
        self.end(
            C.RUN_STOP, metadata={"status": "success" if status == "success" else "aborted", C.SAMPLES_COUNT: samples}
        )


def hyperparameters(cfg: BenchmarkConfig, facts: RunFacts) -> dict[str, Any]:
    """The INIT section's submission facts and hyperparameters, in the order they are logged."""
    tr, mlp = cfg.train, cfg.mlperf
    precision = PRECISION[cfg.model.sequence_dtype]
    slice_size = cfg.loader.batch_size // facts.world_size
    return {
        C.SUBMISSION_BENCHMARK: C.DLRMV4,
        C.SUBMISSION_ORG: mlp.submission_org,
        C.SUBMISSION_DIVISION: mlp.division,
        C.SUBMISSION_PLATFORM: mlp.submission_platform,
        C.SUBMISSION_STATUS: mlp.submission_status,
        C.GLOBAL_BATCH_SIZE: cfg.loader.batch_size,  # the batch of one step, over all ranks
        # Chunks of one step: the dense gradients accumulate over them before the one optimizer step.
        C.GRADIENT_ACCUMULATION_STEPS: facts.chunks,
        C.SEED: int(cfg.seed),
        C.OPT_NAME: "Adam",
        C.OPT_BASE_LR: tr.learning_rate,
        C.OPT_ADAM_BETA_1: tr.adam_beta1,
        C.OPT_ADAM_BETA_2: tr.adam_beta2,
        C.OPT_ADAM_EPSILON: tr.adam_eps,
        C.OPT_WEIGHT_DECAY: tr.weight_decay,
        C.OPT_GRADIENT_CLIP_NORM: tr.grad_clip_norm,
        C.OPT_SPARSE_NAME: "RowWiseAdagrad",
        C.OPT_SPARSE_BASE_LR: tr.sparse_peak_lr,
        C.OPT_LR_WARMUP_STEPS: tr.warmup_steps,
        C.OPT_LR_WARMUP_START_LR: 0.0,
        "eval_every_data_pct": tr.eval_every_data_pct,
        C.MAX_SEQUENCE_LENGTH: cfg.sampler.max_seq_len,
        C.LOWEST_NUMERICAL_PRECISION_IN_LINEAR: precision,
        C.LOWEST_NUMERICAL_PRECISION_IN_ATTN: precision,
        C.LOWEST_NUMERICAL_PRECISION_IN_COMM: COMM_PRECISION[cfg.embeddings.qcomm],
        **{
            key: 1
            for key in (C.TENSOR_PARALLELISM, C.PIPELINE_PARALLELISM, C.CONTEXT_PARALLELISM, C.EXPERT_PARALLELISM)
        },
        C.MICRO_BATCH_SIZE: -(-slice_size // facts.chunks),  # the largest chunk's samples
        C.CONFIG_FILENAME: facts.config_filename,
    }


class _WholeLineHandler(logging.Handler):
    """Appends each record as one whole line, written at once to a file opened for appending, with
    nothing held in a buffer: a write that fails, or falls short, is cut back off the file and its
    error reaches the caller. (logging's FileHandler prints a traceback per failed event and goes on,
    and its buffered stream leaves a partial last line when the disk fills.)"""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        # The first failed write's error: later records are refused with it, unwritten (mllog catches
        # a handler's error and logs a "Failed to encode" line in the event's place).
        self.error: OSError | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.error is not None:
            raise self.error
        data = (self.format(record) + "\n").encode("utf-8")
        whole = os.fstat(self.fd).st_size
        try:
            view = memoryview(data)
            while view:  # a short write is followed by one that raises the cause
                view = view[os.write(self.fd, view) :]
        except OSError as exc:
            os.ftruncate(self.fd, whole)
            self.error = exc
            raise

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        super().close()


_PREFIX = b":::MLLOG "


def _with_values(line: bytes, values: dict[str, Any]) -> bytes:
    """An ``:::MLLOG`` line with its value replaced where its key is in ``values`` (else as it is)."""
    if not line.startswith(_PREFIX):
        return line
    event = json.loads(line[len(_PREFIX) :])
    if event.get("key") not in values or event.get("value") == values[event["key"]]:
        return line
    event["value"] = values[event["key"]]
    return _PREFIX + json.dumps(event).encode() + (b"\n" if line.endswith(b"\n") else b"")
