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


def test_the_libraries_notices_are_silenced_and_nothing_else():
    """Each warning third_party_logs names (seen once per rank on multi-process runs) is not shown; the
    same categories with other messages still are."""
    import warnings

    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        third_party_logs.install()
        for category, start in third_party_logs.SILENCED_WARNINGS:
            warnings.warn(f"{start}: and the rest of the library's text", category)
        warnings.warn("a deprecation of the project's own making", FutureWarning)
        warnings.warn("TBE B100 optimization", UserWarning)
    assert [str(w.message) for w in shown] == ["a deprecation of the project's own making", "TBE B100 optimization"]
    assert logging.getLogger("torch.fx._symbolic_trace").getEffectiveLevel() == logging.ERROR
