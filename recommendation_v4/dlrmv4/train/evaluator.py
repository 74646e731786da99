"""Evaluation: when one is due, the exact AUC over a window's anchors (every rank scores its shares,
then all gather), and its MLPerf events."""

from __future__ import annotations

import time

import torch
from torch.utils.data import DataLoader

from dlrmv4.config import BenchmarkConfig
from dlrmv4.data.loader import WindowDataset, make_window_loader, share_size
from dlrmv4.data.store import Store
from dlrmv4.distributed.cluster import Cluster
from dlrmv4.mlperf.runlog import RunLog
from dlrmv4.model.hstu import DlrmHSTU
from dlrmv4.train.chunks import chunk_bounds, chunked_logits
from dlrmv4.train.history import EvalRecord, RunHistory
from dlrmv4.train.metrics import AucAccumulator, exact_auc
from dlrmv4.train.prefetch import DevicePrefetcher, ready_point, with_next
from dlrmv4.train.schedule import EvalSchedule


class Evaluator:
    """Decides when an eval is due (``train.eval_mode``) and runs it: holdout mode scores the fixed
    holdout window at the eval cadence, next_window mode scores window T + 1 after train window T."""

    def __init__(
        self,
        cfg: BenchmarkConfig,
        store: Store,
        model: DlrmHSTU,
        embeddings,
        chunks: int,
        cluster: Cluster,
        runlog: RunLog,
        train_samples: int,
        holdout: int,
        worker_start: str | None = None,
        dedup_ids: bool = False,
    ) -> None:
        self.cfg, self.store, self.model, self.embeddings = cfg, store, model, embeddings
        self.chunks, self.cluster, self.runlog = chunks, cluster, runlog
        self.train_samples, self.holdout = train_samples, holdout
        self.worker_start = worker_start  # how the eval loader's workers start (make_window_loader)
        self.dedup_ids = dedup_ids  # whether they pack the distinct ids for the lookup
        self.schedule = EvalSchedule(train_samples, cfg.loader.batch_size, cfg.train.eval_every_data_pct)
        # Built at the first holdout eval; its workers stay for the next ones.
        self._holdout_loader: DataLoader | None = None

    def holdout_due(self, samples: int) -> bool:
        """Holdout mode: an eval of the holdout window is due after this many samples."""
        return self.cfg.train.eval_mode == "holdout" and self.schedule.should_eval(samples)

    @property
    def after_each_window(self) -> bool:
        """Next-window mode: window T + 1 is scored after train window T closes."""
        return self.cfg.train.eval_mode == "next_window"

    def run(self, history: RunHistory, window: int, eval_window: int, run_seconds: float) -> EvalRecord:
        """Score ``eval_window`` (with the MLPerf eval events) and record it in ``history``."""
        started = time.perf_counter()
        auc = self.runlog.evaluation(history.samples, self.train_samples, lambda: self.auc(eval_window))
        record = EvalRecord(
            samples_count=history.samples,
            step=history.steps,
            window=window,
            eval_window=eval_window,
            auc=auc,
            seconds=run_seconds + time.perf_counter() - started,
            eval_seconds=time.perf_counter() - started,
        )
        history.evals.append(record)
        if auc < self.cfg.train.target_auc:
            self.runlog.block_start(history.samples, self.train_samples)
        return record

    @torch.no_grad()
    def auc(self, window: int) -> float:
        """Exact AUC over every anchor of ``window`` (each rank scores its shares, then all gather)."""
        self.model.eval()
        acc = AucAccumulator(self.cluster.device)
        rank, world = self.cluster.rank, self.cluster.world_size
        loader = self._holdout_loader if window == self.holdout else None
        if loader is None:
            # The holdout is scored again and again: its loader keeps its workers between evals.
            loader = make_window_loader(
                self.store,
                [window],
                self.cfg,
                rank=rank,
                world_size=world,
                worker_start=self.worker_start,
                dedup_ids=self.dedup_ids,
                persistent_workers=window == self.holdout,
            )
            if window == self.holdout:
                self._holdout_loader = loader
        assert isinstance(loader.dataset, WindowDataset)
        plan = loader.dataset.plan
        slicing = self.cfg.loader.rank_slicing
        # As in training: the next batch's copy overlaps this one's forward, and (train.sparse_pipeline)
        # its ids travel to their tables' ranks while this one computes, so the host's waits for the
        # ids' counts never drain the device between batches.
        pipelined = self.cfg.train.sparse_pipeline
        for (batch, upcoming), part in zip(with_next(DevicePrefetcher(loader, self.cluster.device)), plan):
            ahead = upcoming if pipelined else None
            ready = ready_point(ahead) if ahead is not None else None
            emb = self.embeddings(batch, tuple(chunk_bounds(batch.num_samples, self.chunks)))
            mine = share_size(part.stop - part.start, rank, world, slicing)
            logits = chunked_logits(self.model, batch, emb, self.chunks)
            if ahead is not None:  # with the forward queued, the host's waits leave the device work
                self.embeddings.distribute_ids(ahead, ready)
                self.embeddings.settle_ids()
            acc.update(logits[:mine], batch.label[:mine])  # a stand-in sample (no share) adds nothing
            del emb  # before the next lookup: one batch's rows at a time
        self.model.train()
        if world == 1:
            return acc.compute()
        sizes = [sum(share_size(p.stop - p.start, r, world, slicing) for p in plan) for r in range(world)]
        state = acc.state_dict()
        return exact_auc(
            self.cluster.all_gather_rows(state["scores"], sizes), self.cluster.all_gather_rows(state["labels"], sizes)
        )
