"""Third-party log records and warnings that say nothing to a user, handled in this one place.

FBGEMM checks its version against a table of PyTorch versions each time it loads one of its
libraries, through the root logger: a version the table lacks prints "_fbgemm_torch_compat_table
has no entry" once per library (14 times per command on a GPU), which tells a user nothing; a
version the table says is mismatched ("not guaranteed to be compatible") is worth one line, once.

The warnings below came once per rank on every multi-process run (136 console lines on four GPUs,
26 of them the project's): deprecation notices about the libraries' own internals or about calls
whose replacement the pinned versions do not all have, and a note on a B200 kernel path that is
off on other GPUs. None asks anything of a user, so none is shown (docs/training.md lists them).

c10d's native warnings (a store connection that closed, a client that retries) each come with a dump
of some fifteen native stack frames, around the one line that says the cause; only c10d's errors
are shown, unless ``TORCH_CPP_LOG_LEVEL`` is set.
"""

from __future__ import annotations

import logging
import os
import re
import warnings

_SAYS_NOTHING = "_fbgemm_torch_compat_table has no entry"
_ONCE = "not guaranteed to be"

# (category, start of the message): warnings that say nothing to a user of this benchmark.
SILENCED_WARNINGS = (
    # FBGEMM's table-batched embeddings on any GPU but a B200.
    (UserWarning, "TBE B200 optimization"),
    # TorchRec's sharded tables and DCP's state-dict helpers use ShardedTensor (torch's notice).
    (FutureWarning, "Please use DTensor instead and we are deprecating ShardedTensor"),
    # TorchRec's own call of a torch helper that torch is retiring.
    (UserWarning, "`_get_pg_default_device` will be deprecated"),
    # DDP's broadcast_buffers=False (buffers are not synchronised: every rank builds the same ones);
    # its replacement does not exist in every pinned torch.
    (FutureWarning, "`broadcast_buffers` is deprecated"),
    # The all-gathers of the loop's control messages; all_gather_single is not in every pinned torch.
    (FutureWarning, "`torch.distributed.all_gather_into_tensor` is deprecated"),
)
# torch reads it once, when it is first imported (after dlrmv4 itself, in python -m dlrmv4 and
# python -m dlrmv4.launch alike); the ranks a launcher starts inherit it.
NATIVE_LOG_LEVEL = ("TORCH_CPP_LOG_LEVEL", "ERROR")
# torch's FX tracer logs a change of is_fx_tracing()'s meaning when TorchRec's sharder calls it.
SILENCED_LOGGERS = ("torch.fx._symbolic_trace",)


class _ThirdPartyFilter(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if _SAYS_NOTHING in message:
            return False
        if _ONCE in message:
            key = " ".join(message.split())
            if key in self.seen:
                return False
            self.seen.add(key)
        return True


def install() -> None:
    """Put the filter on the root logger (FBGEMM logs there) and silence the warnings above and c10d's
    native warnings, once per process."""
    root = logging.getLogger()
    if not any(isinstance(f, _ThirdPartyFilter) for f in root.filters):
        root.addFilter(_ThirdPartyFilter())
    for category, start in SILENCED_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(start), category=category)
    for name in SILENCED_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault(*NATIVE_LOG_LEVEL)
