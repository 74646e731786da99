"""The line of a rank whose collective failed (dlrmv4/distributed/liveness.py): who left, as the store's
answer tells it, whether anything timed out, and the transport's own words cut at a word's end."""

from __future__ import annotations

import pytest
import torch

from dlrmv4.distributed import liveness
from dlrmv4.distributed.cluster import Cluster

GLOO_CLOSED = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:29374. "
    "This is typically caused by a remote worker crashing. Check the logs of the remote worker for the root cause "
    "of the failure, which may be bugs in the application"
)
GLOO_TIMEOUT = "[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 20000ms for recv operation to complete"


def _cluster(rank: int, world: int = 4, local: int = 2) -> Cluster:
    return Cluster(rank, world, rank % local, local, torch.device("cpu"), "gloo", None, 20.0)


def test_the_silent_ranks_are_named():
    assert liveness._who_left(_cluster(0), [3]) == "another rank exited or stopped answering: rank 3"
    assert liveness._who_left(_cluster(0), [2, 3]).endswith("ranks 2, 3")


def test_under_torchrun_a_store_gone_is_the_node_of_rank_0s(monkeypatch):
    # The ranks' store is the launcher's on the node of global ranks 0 .. local world - 1, which need
    # not be NODE_RANK 0 (that node holds the rendezvous store, alive).
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert liveness._who_left(_cluster(2), None) == (
        "the node of ranks 0-1 stopped or failed (its launcher held the ranks' store, gone with it)"
    )
    assert liveness._who_left(_cluster(1, world=2, local=1), None).startswith("the node of rank 0 stopped")
    assert liveness._who_left(_cluster(1), None) == "this node's launcher, which held the ranks' store, is gone"


def test_without_torchrun_a_store_gone_is_rank_0s_process(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert liveness._who_left(_cluster(1), None).startswith("rank 0 exited or stopped answering (its process held")


@pytest.mark.parametrize(
    "text, said",
    [(GLOO_TIMEOUT, " (timeout 20 s)"), (GLOO_CLOSED, " (its connection closed)"), ("NCCL error: unknown", "")],
)
def test_a_timeout_is_said_only_where_one_happened(text, said):
    assert liveness._how_it_failed(_cluster(0), text) == said


def test_the_transports_words_end_at_a_words_end():
    clipped = liveness._clipped(GLOO_CLOSED, liveness.LIBRARY_TEXT_CHARS)
    assert len(clipped) <= liveness.LIBRARY_TEXT_CHARS + 4 and clipped.endswith(" ...")
    assert GLOO_CLOSED.startswith(clipped[:-4]) and GLOO_CLOSED[len(clipped) - 4] == " "
    assert liveness._clipped(GLOO_TIMEOUT, liveness.LIBRARY_TEXT_CHARS) == GLOO_TIMEOUT
