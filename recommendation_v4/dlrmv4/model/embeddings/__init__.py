"""The sparse embedding tables: one interface, two backends (TorchRec/FBGEMM and plain PyTorch),
both trained with FBGEMM's row-wise Adagrad and both filling the model's ``SequenceEmbeddings``.

Where each concern lives:
  sequence.py          SequenceEmbeddings: the rows of one batch, as the model consumes them
  tables.py            table names and sizes, seeded initial rows, the SparseEmbeddings interface
  plain_backend/       the plain backend: replicated fp32 tables, their lookup, update and exchange
  torchrec_backend/    the TorchRec backend: DistributedModelParallel, fused row-wise Adagrad, the
                       sharding plan and codecs, and every reliance on TorchRec's insides (compat.py)
  wire.py              the all-to-all's precision, shared by both
  backend.py           picking a backend and building it (make_embeddings)
The tables' checkpoint entry (one format for both backends) is dlrmv4/checkpoint/tables.py.

The batch's id features and their KeyedJaggedTensor layout are the data side's
(``data/sparse_features.py``).
"""

from dlrmv4.checkpoint.tables import TableState
from dlrmv4.model.embeddings.backend import (
    looks_up_distinct_ids,
    make_embeddings,
    needs_process_group,
    resolve_backend,
)
from dlrmv4.model.embeddings.plain_backend.tables import PlainEmbeddings
from dlrmv4.model.embeddings.sequence import SequenceEmbeddings
from dlrmv4.model.embeddings.tables import (
    SHARED_TABLES,
    TABLE_NAMES,
    SparseEmbeddings,
    TableSpec,
    init_rows,
    store_table_counts,
    table_features,
    table_specs,
)
from dlrmv4.model.embeddings.torchrec_backend.compat import torchrec_works
from dlrmv4.model.embeddings.torchrec_backend.tables import TorchRecEmbeddings

__all__ = [
    "SHARED_TABLES",
    "TABLE_NAMES",
    "PlainEmbeddings",
    "SequenceEmbeddings",
    "SparseEmbeddings",
    "TableSpec",
    "TableState",
    "TorchRecEmbeddings",
    "init_rows",
    "looks_up_distinct_ids",
    "make_embeddings",
    "needs_process_group",
    "resolve_backend",
    "store_table_counts",
    "table_features",
    "table_specs",
    "torchrec_works",
]
