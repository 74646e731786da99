"""The memory plan: what one process of a run needs, made before anything is allocated.

Per process (rank), in device memory unless stated: the embedding tables by placement (TorchRec's
planner lays them out for the target world size; fp32 rows + one row-wise Adagrad value per row on
the fullest rank; ``uvm`` tables live in host memory, ``uvm_caching`` ones too plus an HBM cache
of ``CACHE_LOAD_FACTOR`` of their rows; the plain backend keeps every table on every rank), the
dense model (weights, gradients, Adam state, DDP buckets), a headroom share of the device, and the
step's peak: the largest of its three phases (``lookup``: the batch, ids, looked-up rows and the
all-to-all send buffer; ``chunks``: looked-up rows, their gradients and one chunk's activations;
``update``: looked-up rows, their gradients and the all-to-all gradients received).

Choice (where ``model.recompute`` is auto or ``train.chunks`` is 0; fixed values are honoured): the
fitting (recompute, chunks) pair with the smallest estimated step time, ``RECOMPUTE_COST[mode] x
chunk_efficiency(samples per chunk)``. When the tables do not fit and the config leaves a table's
placement open, the contextual cross tables move to ``uvm`` one at a time, largest first, until a
pair fits. ``resolve.resolved_config`` writes the choice into the config the run goes on with.

Where each part lives:
  costs.py        the measured costs (recompute modes, chunk sizes, host-memory tables), with sources
  activations.py  what one chunk's forward keeps for its backward, per token, per recompute mode
  memory_plan.py  the values: target, table uses, consumers, candidates, the plan
  tables.py       the tables' layout on the fullest rank (TorchRec's planner, or replicas)
  consumers.py    the dense model, the step's buffers, the checkpoint's host staging
  disk.py         the checkpoints' bytes against the run directory's free disk
  search.py       make_memory_plan: the candidates and layouts tried, the fastest that fits
  explain.py      the plan in words, and a refusal's cause and knobs
  resolve.py      the choice written into the config
  machine.py      the plan for this machine (``plan`` command) and for this run
"""
