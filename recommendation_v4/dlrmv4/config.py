"""Typed configuration: one frozen dataclass per section, each field with its default, help text
and allowed range or choices (``config_loading.py`` turns presets, TOML files and flags into one
``BenchmarkConfig`` and validates every field against them). Nothing here is global: a
``BenchmarkConfig`` is passed down explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

YAMBDA_SIZES = ("50m", "500m", "5b")
SYNTHETIC_SIZES = ("tiny", "small", "medium", "50m", "1b", "5b")


def _field(
    default: Any, help: str, *, min: float | None = None, max: float | None = None, choices: Sequence[Any] | None = None
) -> Any:
    return field(default=default, metadata={"help": help, "min": min, "max": max, "choices": choices})


@dataclass(frozen=True)
class DatasetConfig:
    source: str = _field("synthetic", "where the raw Yambda-schema parquet comes from", choices=("synthetic", "yambda"))
    size: str = _field(
        "tiny",
        "dataset size: 50m/500m/5b for yambda, tiny/small/medium/50m/1b/5b for synthetic",
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
    attention_kernels: str = _field(
        "auto",
        "kernels of the STU layers' attention with the Triton ops: gluon (the warp-specialized Hopper "
        "kernels, forward and backward: sm_90, bf16/fp16, head dims 64 or 128), triton (the portable "
        "kernels), or auto (where gluon applies, its forward with the portable backward, the faster "
        "pair measured; triton elsewhere)",
        choices=("auto", "gluon", "triton"),
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
    sparse_learning_rate: float = _field(
        0.0,
        "peak learning rate of the tables' row-wise Adagrad, warmed up with the dense one (0: the dense "
        "learning_rate, as the closed division requires)",
        min=0.0,
        max=10.0,
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
    warm_up: str = _field(
        "auto",
        "before RUN_START, run the step's and the eval's kernels on synthetic batches (every sequence-length "
        "bucket and chunk shape, never the dataset) so that Triton compiles and autotunes them outside the timed "
        "run; the run is the same bit for bit; auto: where the model runs its Triton kernels",
        choices=("auto", "true", "false"),
    )
    sparse_pipeline: bool = _field(
        True,
        "TorchRec tables: start the next batch's id distribution (TorchRec's input all-to-alls) while "
        "this step, or eval batch, computes (the same numbers; false: each lookup distributes its own ids first)",
    )
    max_steps: int = _field(
        0, "stop after this many optimizer steps (0: run to the target or the end of the data)", min=0
    )
    run_dir: str = _field("runs/default", "where checkpoints, the run log and the report go")
    checkpoint_every_steps: int = _field(0, "checkpoint every N steps (0: off)", min=0)
    checkpoint_every_seconds: float = _field(0.0, "checkpoint every N seconds (0: off)", min=0.0)
    checkpoint_every_window: bool = _field(True, "checkpoint at the end of every train window")
    final_checkpoint: bool = _field(
        True,
        "write a checkpoint when the run stops (its target, the end of the data, max_steps); false: no stop "
        "writes one (runs that are never continued, as RCP seeds, or whose checkpoint the disk cannot hold; "
        "continuing such a run replays from its newest checkpoint)",
    )
    keep_last_checkpoints: int = _field(
        2,
        "restore points kept on disk, each on a chain of its own: the newest checkpoint, then the newest "
        "of each older chain (a whole checkpoint and its deltas), with the checkpoints their chains go back through",
        min=1,
    )
    checkpoint_full_every: int = _field(
        8,
        "every Nth checkpoint holds the whole tables; the ones between are deltas: the dense state and "
        "only the table rows that changed since the checkpoint before (1: every checkpoint whole)",
        min=1,
    )
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
    tensorboard: bool = _field(
        True,
        "write TensorBoard scalars (loss, learning rates, samples/s, GPU memory, evals, checkpoint "
        "waits) into <run_dir>/tensorboard from rank 0, where the tensorboard package is installed",
    )
    allow_changed_settings: bool = _field(
        False,
        "resume a checkpoint even when settings that shape the run (the "
        "seed, data, model, optimizers, schedule) differ from the ones it was "
        "written with (they are named in the log); without it such a resume stops",
    )

    @property
    def sparse_peak_lr(self) -> float:
        """The tables' peak learning rate: ``sparse_learning_rate``, or the dense one where that is 0."""
        return self.sparse_learning_rate or self.learning_rate


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
    plan_host_memory_gib: float = _field(
        0.0, "host RAM of one node in GiB (0: this machine's, or its cgroup limit if lower)", min=0.0
    )
    plan_disk_gib: float = _field(
        0.0,
        "free disk of the run directory in GiB, which a whole checkpoint must fit (0: its free space here)",
        min=0.0,
    )
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
