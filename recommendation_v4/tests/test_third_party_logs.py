"""FBGEMM's version-table records: the empty one dropped, a mismatch said once (third_party_logs)."""

from __future__ import annotations

import logging

import dlrmv4  # noqa: F401  (installs the filter)
from dlrmv4 import third_party_logs


def test_fbgemm_version_table_records_are_filtered(caplog):
    third_party_logs.install()  # a second install adds no second filter
    assert sum(isinstance(f, third_party_logs._ThirdPartyFilter) for f in logging.getLogger().filters) == 1
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            logging.warning("\n  \033[33m\n  _fbgemm_torch_compat_table has no entry for 1.6.0 of FBGEMM;\n")
            logging.warning("FBGEMM_GPU version is 1.6.0, which is not guaranteed to be\n compatible with PyTorch 2.11")
        logging.warning("something else")
    messages = [r.getMessage() for r in caplog.records]
    assert sum("has no entry" in m for m in messages) == 0
    assert sum("not guaranteed to be" in m for m in messages) == 1
    assert messages[-1] == "something else"
