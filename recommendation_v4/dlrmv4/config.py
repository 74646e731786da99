"""Typed configuration: dataclasses, TOML presets, one CLI flag per field.

Precedence (the MLPerf rule): field defaults < preset TOML < ``--config`` TOML < CLI flags.
Every field is validated against the range or choices in its metadata; an error names the
field, the bad value and what is allowed. Nothing here is global: ``load_config`` returns a
frozen ``BenchmarkConfig`` that callers pass down explicitly.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from dlrmv4.errors import UserError, one_line

PRESET_DIR = Path(__file__).parent / "configs"
DEFAULT_PRESET = "synthetic-tiny"

YAMBDA_SIZES = ("50m", "500m", "5b")
SYNTHETIC_SIZES = ("tiny", "small", "medium", "50m", "1b")


def _field(
    default: Any, help: str, *, min: float | None = None, max: float | None = None, choices: Sequence[Any] | None = None
) -> Any:
    return field(default=default, metadata={"help": help, "min": min, "max": max, "choices": choices})


@dataclass(frozen=True)
class DatasetConfig:
    source: str = _field("synthetic", "where the raw Yambda-schema parquet comes from", choices=("synthetic", "yambda"))
    size: str = _field(
        "tiny",
        "dataset size: 50m/500m/5b for yambda, tiny/small/medium/50m for synthetic",
        choices=tuple(dict.fromkeys(YAMBDA_SIZES + SYNTHETIC_SIZES)),
    )
    # dataset.size admits both families here; validate_relations narrows it per source.
    data_path: str = _field("data", "root folder for raw files, the hub cache and processed stores")
    hub_repo_id: str = _field("yandex/yambda", "Hugging Face dataset repository")
    hub_revision: str = _field("main", "hub revision (branch, tag or 40-hex commit) to download")
    synthetic_seed: int = _field(20240601, "seed of the synthetic generator", min=0, max=2**63 - 1)

    @property
    def name(self) -> str:
        return f"{self.source}-{self.size}"


@dataclass(frozen=True)
class PreprocessConfig:
    last_timestamp: int = _field(
        0,
        "end of the data (exclusive); 0: the data's largest timestamp (its own events "
        "are dropped, as the reference does)",
        min=0,
        max=2**32 - 1,
    )
    test_span_seconds: int = _field(86_400, "length of the held-out test span at the end", min=1)
    split_gap_seconds: int = _field(1_800, "gap between the train span and the test span", min=0)
    num_train_days: int = _field(
        300, "number of one-window days in the train span (last one is the eval holdout)", min=2, max=100_000
    )
    window_seconds: int = _field(86_400, "length of one streaming window", min=1)
    session_gap_seconds: int = _field(1_800, "inactivity that starts a new session", min=1)
    listen_threshold_pct: int = _field(
        50, "played_ratio_pct at or above which a listen is listen_plus", min=0, max=65_535
    )
    min_history: int = _field(4_086, "user-local event index an anchor needs at least", min=0)
    null_ratio_policy: str = _field(
        "skip",
        "listens whose played_ratio_pct is null: skip (the reference: the ratio "
        "reads 0, a skip, label 0), drop, or error",
        choices=("skip", "drop", "error"),
    )
    rows_per_chunk: int = _field(
        2_000_000,
        "raw rows per chunk, in whole parquet row groups (at least one): a worker's unit of work, which sets its "
        "memory (0.45 / 0.60 / 0.94 GB at 1 / 2 / 4 M rows)",
        min=1_000,
    )
    workers: int = _field(
        0, "processes that read, check and split the raw chunks (0: one per usable core); the store is the same", min=0
    )


@dataclass(frozen=True)
class SamplerConfig:
    max_seq_len: int = _field(4_096, "tokens per sample: history + 8 contextual + 1 candidate", min=10)
    scan_window: int = _field(20_000, "events before the anchor scanned for the history pools", min=1)
    uid_rows: int = _field(
        1_000_001, "rows of the uid table: the raw uid is the row (no modulo; a larger uid is refused)", min=1
    )
    user_artist_rows: int = _field(100_000_000, "rows of the hashed user x artist table", min=1)
    user_album_rows: int = _field(40_000_000, "rows of the hashed user x album table", min=1)
    user_hour_rows: int = _field(24_000_000, "rows of the hashed user x hour table", min=1)
    item_hour_rows: int = _field(40_000_000, "rows of the hashed item x hour table", min=1)
    artist_hour_rows: int = _field(32_000_000, "rows of the hashed artist x hour table", min=1)
    user_organic_rows: int = _field(2_000_000, "rows of the hashed user x is_organic table", min=1)
    user_artist_hour_rows: int = _field(40_000_000, "rows of the hashed user x artist x hour table", min=1)

    @property
    def history_length(self) -> int:
        # The "+9": 8 contextual tokens and 1 candidate share the sequence budget.
        return self.max_seq_len - 9

    @property
    def per_pool_length(self) -> int:
        return self.history_length // 3


@dataclass(frozen=True)
class LoaderConfig:
    batch_size: int = _field(
        1_024,
        "global batch size: samples per optimizer step over all processes (each of "
        "the world's processes takes an equal contiguous slice)",
        min=1,
    )
    num_workers: int = _field(2, "loader worker processes (0 builds batches in the main process)", min=0, max=256)
    shuffle_within_window: bool = _field(False, "seeded shuffle of anchors inside each window")
    window_order: str = _field(
        "index",
        "order of a window's anchors: index (ascending event index, user-major, "
        "the reference's) or time (ascending timestamp, ties by index)",
        choices=("index", "time"),
    )
    rank_slicing: str = _field(
        "strided",
        "how the processes share a global batch: strided (rank r takes samples "
        "r, r + W, ..., the reference's), contiguous (equal consecutive slices) or "
        "balanced (equal sample counts, token sums balanced)",
        choices=("strided", "contiguous", "balanced"),
    )
    prefetch_batches: int = _field(2, "batches each worker prepares ahead", min=1, max=64)


@dataclass(frozen=True)
class ModelConfig:
    embedding_dim: int = _field(512, "dimension of every embedding table", min=1)
    d_model: int = _field(512, "width D of the sequence model", min=1)
    num_layers: int = _field(3, "STU layers", min=1, max=64)
    num_heads: int = _field(4, "attention heads", min=1, max=64)
    qk_dim: int = _field(128, "query/key dimension per head", min=16, max=256)
    v_dim: int = _field(128, "u/v dimension per head", min=16, max=256)
    preprocessor_hidden: int = _field(256, "hidden width of the three preprocessor branches", min=1)
    action_dim: int = _field(8, "learned vector per history pool bit", min=1)
    item_tower_hidden: int = _field(512, "hidden width of the item tower", min=1)
    head_hidden: int = _field(512, "hidden width of the logit MLP", min=1)
    num_position_buckets: int = _field(8_192, "rows of the position table", min=16)
    num_time_buckets: int = _field(
        2_048, "largest time-gap bucket: the time table has this many rows plus one (the reference's)", min=2
    )
    time_bucket_seconds: float = _field(60.0, "time gap unit: bucket = int(sqrt(gap / unit))", min=1e-3)
    input_dropout: float = _field(0.2, "dropout after the position/time encoding", min=0.0, max=0.99)
    linear_dropout: float = _field(0.1, "dropout on each STU layer's [u, attn, u*LN(attn)]", min=0.0, max=0.99)
    layer_norm_eps: float = _field(1e-6, "epsilon of the STU layer norms", min=0.0, max=1.0)
    mlp_layer_norm_eps: float = _field(
        1e-5,
        "epsilon of the other layer norms: the input towers, the item tower, the head and the postprocessor",
        min=0.0,
        max=1.0,
    )
    loss_scale: float = _field(0.2, "multiplier of the mean BCE loss", min=0.0)
    kernels: str = _field(
        "auto",
        "operator implementation: Triton kernels, the PyTorch reference, or auto (Triton on GPUs)",
        choices=("auto", "triton", "pytorch"),
    )
    sequence_dtype: str = _field(
        "bfloat16",
        "autocast dtype of the sequence model (head and loss stay fp32)",
        choices=("bfloat16", "float16", "float32"),
    )
    recompute: str = _field(
        "auto",
        "activations the STU layers recompute in the backward instead of keeping: none, "
        "cheap (the normed input, uvqk and the output block's y), layer (everything but the "
        "layer's input), or auto (the memory plan picks)",
        choices=("auto", "none", "cheap", "layer"),
    )
    last_layer: str = _field(
        "candidates",
        "rows the last STU layer computes: candidates (U, Q, attention and the "
        "output block for each sequence's candidate row only, K and V for all rows; the "
        "reference's, the same function) or all",
        choices=("candidates", "all"),
    )


@dataclass(frozen=True)
class EmbeddingConfig:
    embedding_backend: str = _field(
        "auto",
        "embedding engine: TorchRec (FBGEMM fused row-wise Adagrad), plain "
        "PyTorch (same math), or auto (TorchRec where it imports)",
        choices=("auto", "torchrec", "plain"),
    )
    item_rows: int = _field(0, "rows of the item table (0: the store's item count)", min=0)
    artist_rows: int = _field(0, "rows of the artist table (0: from the store)", min=0)
    album_rows: int = _field(0, "rows of the album table (0: from the store)", min=0)
    sharding_types: str = _field(
        "",
        "TorchRec sharding type per table, 'table=type,...' ('*' for every table; "
        "types: row_wise, column_wise, table_wise); a table not named: row_wise (the "
        "reference)",
    )
    placement: str = _field(
        "",
        "TorchRec table placement, 'table=where,...' ('*' for every table; where: hbm, "
        "uvm, uvm_caching: host memory mapped into the device, uncached or with an HBM cache); "
        "a table not named: hbm, unless the memory plan moves it to host memory",
    )
    hbm_cap_gib: float = _field(
        0.0, "device memory per rank the TorchRec planner may fill with tables (GiB; 0: the device's own size)", min=0.0
    )
    qcomm: str = _field(
        "fp16",
        "precision of the embedding all-to-all, rows forward and gradients backward: fp16 (the "
        "reference's, no loss scale), bf16 or none (the rows' own); the plain backend rounds its rows "
        "and gradients the same way",
        choices=("none", "fp16", "bf16"),
    )
    dedup_ids: bool = _field(
        True,
        "TorchRec: each rank looks up, and the all-to-all carries, each distinct history id of its "
        "batch once (the loader finds them); the same rows forward, and a row's token gradients are "
        "summed before the all-to-all instead of after it. The plain backend, which exchanges no "
        "rows, looks up every token's id either way",
    )


@dataclass(frozen=True)
class TrainConfig:
    learning_rate: float = _field(
        1e-6, "peak learning rate of both optimizers (closed division: [0.5, 1.5] x 1e-6 x GBS/8192)", min=0.0, max=10.0
    )
    warmup_steps: int = _field(24_000, "linear warm-up from 0 to the peak over this many steps", min=0)
    adam_beta1: float = _field(0.95, "Adam beta1 (dense parameters)", min=0.0, max=1.0)
    adam_beta2: float = _field(0.999, "Adam beta2", min=0.0, max=1.0)
    adam_eps: float = _field(1e-8, "Adam epsilon", min=0.0)
    weight_decay: float = _field(0.0, "Adam weight decay", min=0.0)
    grad_clip_norm: float = _field(1.0, "clip the dense gradients' global norm to this (0: off)", min=0.0)
    adagrad_eps: float = _field(1e-8, "row-wise Adagrad epsilon (embedding tables)", min=0.0)
    eval_mode: str = _field(
        "holdout",
        "evaluate on the fixed last train window, or on window T+1 after T",
        choices=("holdout", "next_window"),
    )
    eval_every_data_pct: float = _field(0.001, "eval interval as a fraction of the train samples", min=1e-9, max=1.0)
    target_auc: float = _field(0.75, "stop at the first eval with AUC at or above this", min=0.0, max=1.0)
    chunks: int = _field(
        0,
        "dense forward/backward passes per optimizer step over this rank's slice of the global "
        "batch (one lookup, one sparse update, one Adam step; the same step for any count); 0: the "
        "memory plan picks",
        min=0,
        max=65_536,
    )
    sparse_pipeline: bool = _field(
        True,
        "TorchRec tables: start the next batch's id distribution (TorchRec's input all-to-alls) while "
        "this step computes (the same numbers; false: each step distributes its own ids first)",
    )
    max_steps: int = _field(
        0, "stop after this many optimizer steps (0: run to the target or the end of the data)", min=0
    )
    run_dir: str = _field("runs/default", "where checkpoints, the run log and the report go")
    checkpoint_every_steps: int = _field(0, "checkpoint every N steps (0: off)", min=0)
    checkpoint_every_seconds: float = _field(0.0, "checkpoint every N seconds (0: off)", min=0.0)
    checkpoint_every_window: bool = _field(True, "checkpoint at the end of every train window")
    keep_last_checkpoints: int = _field(2, "complete checkpoints kept on disk", min=1)
    async_checkpoints: bool = _field(
        True,
        "write checkpoints in the background: the step waits only while the state is copied to "
        "host memory (as much host memory again as the checkpointed state); false: the step "
        "waits for the whole write",
    )
    profile_steps: str = _field(
        "",
        "step windows to record with the torch profiler on every rank, 'start-end,...' "
        "(half-open; Chrome traces in <run_dir>/traces, merge with merge-traces)",
    )
    allow_changed_settings: bool = _field(
        False,
        "resume a checkpoint even when settings that shape the run (the "
        "seed, data, model, optimizers, schedule) differ from the ones it was "
        "written with (they are named in the log); without it such a resume stops",
    )


@dataclass(frozen=True)
class DistributedConfig:
    backend: str = _field(
        "auto",
        "torch.distributed backend of multi-process runs (auto: nccl on GPUs, gloo on the CPU)",
        choices=("auto", "nccl", "gloo"),
    )
    timeout_seconds: float = _field(
        600.0, "a collective that waits longer than this fails the run (a rank died or hangs)", min=1.0
    )


@dataclass(frozen=True)
class PlanConfig:
    plan_world_size: int = _field(
        0, "processes (GPUs) the memory plan is made for (0: this run's world size)", min=0, max=1_000_000
    )
    plan_gpus_per_node: int = _field(
        0, "processes per node the plan assumes, for host memory (0: this run's, at most 8)", min=0, max=1_024
    )
    plan_device_memory_gib: float = _field(
        0.0, "memory of one device in GiB (0: this device's; on the CPU, this machine's RAM)", min=0.0
    )
    plan_host_memory_gib: float = _field(0.0, "host RAM of one node in GiB (0: this machine's)", min=0.0)
    plan_headroom_fraction: float = _field(
        0.06,
        "share of device memory kept free for the allocator's slack, the runtime and the communication library",
        min=0.0,
        max=0.9,
    )


@dataclass(frozen=True)
class MlperfConfig:
    division: str = _field(
        "closed",
        "MLPerf division: closed pins every hyperparameter but the LR and the batch "
        "size (checked before the run starts on the reference dataset)",
        choices=("closed", "open"),
    )
    submission_org: str = _field("reference", "submitting organisation (submission_org)")
    submission_platform: str = _field("unspecified", "system name (submission_platform)")
    submission_status: str = _field(
        "onprem", "availability (submission_status)", choices=("onprem", "cloud", "preview", "research")
    )
    log_file: str = _field("", "the MLPerf run log (:::MLLOG lines); empty: <run_dir>/mlperf_log.txt")


@dataclass(frozen=True)
class BenchmarkConfig:
    seed: int = _field(0, "the run's seed; every generator derives from it", min=0, max=2**63 - 1)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    embeddings: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    mlperf: MlperfConfig = field(default_factory=MlperfConfig)


SECTIONS: dict[str, type] = {
    "dataset": DatasetConfig,
    "preprocess": PreprocessConfig,
    "sampler": SamplerConfig,
    "loader": LoaderConfig,
    "model": ModelConfig,
    "embeddings": EmbeddingConfig,
    "train": TrainConfig,
    "distributed": DistributedConfig,
    "plan": PlanConfig,
    "mlperf": MlperfConfig,
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _section_fields() -> list[tuple[str | None, dataclasses.Field]]:
    out: list[tuple[str | None, dataclasses.Field]] = []
    for f in dataclasses.fields(BenchmarkConfig):
        if f.name in SECTIONS:
            out.extend((f.name, sf) for sf in dataclasses.fields(SECTIONS[f.name]))
        else:
            out.append((None, f))
    return out


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One typed flag per config field (flat names, unique across sections)."""
    parser.add_argument(
        "--preset", default=DEFAULT_PRESET, help=f"named preset from {PRESET_DIR.name}/ (default {DEFAULT_PRESET})"
    )
    parser.add_argument("--config", default=None, help="TOML file applied on top of the preset")
    group = parser.add_argument_group("configuration (CLI wins over files)")
    for section, f in _section_fields():
        parsers: dict[type, Callable[[str], Any]] = {int: int, float: float, str: str, bool: _parse_bool}
        kind = parsers[_field_type(f)]
        meta = f.metadata
        extra = f" [{meta['min']}..{meta['max']}]" if meta.get("min") is not None else ""
        group.add_argument(
            _flag(f.name),
            dest=f"cfg__{section or ''}__{f.name}",
            type=kind,
            default=None,
            metavar=_field_type(f).__name__.upper(),
            help=f"{meta.get('help', '')}{extra} ({section or 'run'})",
        )


def _field_type(f: dataclasses.Field) -> type:
    return {"int": int, "float": float, "str": str, "bool": bool}[
        f.type if isinstance(f.type, str) else f.type.__name__
    ]


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise UserError(f"config file {path} does not exist")
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"config file {path} is not valid TOML: {one_line(exc)}")


def _merge_toml(values: dict[tuple[str | None, str], Any], data: dict[str, Any], origin: str) -> None:
    known = {(s, f.name) for s, f in _section_fields()}
    for key, val in data.items():
        if key in SECTIONS:
            if not isinstance(val, dict):
                raise UserError(f"{origin}: [{key}] must be a table")
            for sub, subval in val.items():
                if (key, sub) not in known:
                    raise UserError(f"{origin}: unknown key {key}.{sub}")
                values[(key, sub)] = subval
        elif (None, key) in known:
            values[(None, key)] = val
        else:
            raise UserError(f"{origin}: unknown key {key}")


def _check(section: str | None, f: dataclasses.Field, value: Any) -> Any:
    name = f"{section}.{f.name}" if section else f.name
    want = _field_type(f)
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        raise UserError(f"config field {name} must be {want.__name__}, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):  # NaN passes every range check
        raise UserError(f"config field {name}={value} must be a finite number")
    meta = f.metadata
    if meta.get("choices") is not None and value not in meta["choices"]:
        raise UserError(f"config field {name}={value!r} is not one of {', '.join(map(str, meta['choices']))}")
    lo, hi = meta.get("min"), meta.get("max")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise UserError(
            f"config field {name}={value} is outside the allowed range "
            f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        )
    return value


def build_config(values: dict[tuple[str | None, str], Any]) -> BenchmarkConfig:
    """Validated config from (section, field) -> value; missing fields keep their defaults."""
    sections: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    top: dict[str, Any] = {}
    fields_by_key = {(s, f.name): f for s, f in _section_fields()}
    for (section, name), value in values.items():
        checked = _check(section, fields_by_key[(section, name)], value)
        (sections[section] if section else top)[name] = checked
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if f.name not in sections[section]:
                _check(section, f, f.default)
    cfg = BenchmarkConfig(**top, **{s: SECTIONS[s](**kv) for s, kv in sections.items()})
    validate_relations(cfg)
    return cfg


def validate_relations(cfg: BenchmarkConfig) -> None:
    ds = cfg.dataset
    allowed = YAMBDA_SIZES if ds.source == "yambda" else SYNTHETIC_SIZES
    if ds.size not in allowed:
        raise UserError(
            f"config field dataset.size={ds.size!r} is not valid for source {ds.source!r}; "
            f"choose one of {', '.join(allowed)}"
        )
    if cfg.model.num_position_buckets < cfg.sampler.max_seq_len:
        raise UserError(
            f"config field model.num_position_buckets={cfg.model.num_position_buckets} must be at least "
            f"sampler.max_seq_len={cfg.sampler.max_seq_len} (one position per token)"
        )
    if cfg.sampler.per_pool_length < 1:
        raise UserError(
            f"config field sampler.max_seq_len={cfg.sampler.max_seq_len} leaves no history "
            "(needs at least 12: 9 reserved tokens + 3 pools)"
        )


def load_config(
    preset: str | None = DEFAULT_PRESET,
    config_file: str | None = None,
    overrides: dict[tuple[str | None, str], Any] | None = None,
) -> BenchmarkConfig:
    values: dict[tuple[str | None, str], Any] = {}
    if preset:
        path = PRESET_DIR / f"{preset}.toml"
        if not path.exists():
            raise UserError(f"unknown preset {preset!r}; available: {', '.join(list_presets())}")
        _merge_toml(values, _read_toml(path), f"preset {preset}")
    if config_file:
        _merge_toml(values, _read_toml(Path(config_file)), str(config_file))
    values.update(overrides or {})
    return build_config(values)


def config_from_args(args: argparse.Namespace) -> BenchmarkConfig:
    overrides: dict[tuple[str | None, str], Any] = {}
    for key, value in vars(args).items():
        if key.startswith("cfg__") and value is not None:
            _, section, name = key.split("__", 2)
            overrides[(section or None, name)] = value
    return load_config(args.preset, args.config, overrides)


def to_dict(cfg: BenchmarkConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def to_toml(cfg: BenchmarkConfig) -> str:
    lines: list[str] = []
    data = to_dict(cfg)
    for key, val in data.items():
        if not isinstance(val, dict):
            lines.append(f"{key} = {_toml_value(val)}")
    for key, val in data.items():
        if isinstance(val, dict):
            lines.append(f"\n[{key}]")
            lines.extend(f"{k} = {_toml_value(v)}" for k, v in val.items())
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(v)
