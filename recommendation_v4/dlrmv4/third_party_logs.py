"""Third-party log records that say nothing to a user, filtered in this one place.

FBGEMM checks its version against a table of PyTorch versions each time it loads one of its
libraries, through the root logger: a version the table lacks prints "_fbgemm_torch_compat_table
has no entry" once per library (14 times per command on a GPU), which tells a user nothing; a
version the table says is mismatched ("not guaranteed to be compatible") is worth one line, once.
"""

from __future__ import annotations

import logging

_SAYS_NOTHING = "_fbgemm_torch_compat_table has no entry"
_ONCE = "not guaranteed to be"


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
    """Put the filter on the root logger (FBGEMM logs there), once per process."""
    root = logging.getLogger()
    if not any(isinstance(f, _ThirdPartyFilter) for f in root.filters):
        root.addFilter(_ThirdPartyFilter())
