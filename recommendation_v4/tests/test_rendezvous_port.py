"""What answers at a rendezvous port (dlrmv4/distributed/rendezvous_port.py: probe_port), over real sockets: torch's
own c10d store, another program that answers, one that never does, and nothing at all; and the
launcher's reading of torchrun's --rdzv-conf."""

from __future__ import annotations

import datetime
import socket
import threading
import time

import pytest
import torch.distributed as dist

from dlrmv4.distributed.rendezvous_port import port_held_line, port_is_free, probe_port, wait_for_store
from dlrmv4.launch import conf_value, hosts_the_store, join_timeout, with_join_timeout


@pytest.mark.parametrize("use_libuv", [True, False])
def test_torch_s_own_store_answers_as_a_store(use_libuv):
    """The probe speaks the store's protocol: a change in torch's would fail here first."""
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        use_libuv=use_libuv,
        timeout=datetime.timedelta(seconds=10),
    )
    assert probe_port("127.0.0.1", store.port).kind == "store"
    assert wait_for_store("127.0.0.1", store.port, 5).kind == "store"
    store.set("still", "served")  # the probe left the store as it was
    assert store.get("still") == b"served" and not port_is_free(store.port)


@pytest.fixture
def listener():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock


def test_a_program_that_answers_otherwise_is_named_at_once(listener):
    def greet() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")
            conn.recv(64)

    threading.Thread(target=greet, daemon=True).start()
    port = listener.getsockname()[1]
    started = time.monotonic()
    answer = wait_for_store("127.0.0.1", port, 30)
    assert time.monotonic() - started < 5
    assert (answer.kind, answer.said) == ("other", "it answered 'SSH-2.0-OpenSSH_9.2'")
    assert port_held_line("127.0.0.1", port, answer) == (
        f"MASTER_PORT {port} on 127.0.0.1 is held by another program (it answered 'SSH-2.0-OpenSSH_9.2'): stop "
        "it, or give every node another MASTER_PORT"
    )
    assert not port_is_free(port)


def test_a_program_that_never_answers_is_waited_for_up_to_the_timeout(listener):
    port = listener.getsockname()[1]  # the kernel accepts the connection; no one ever reads it
    started = time.monotonic()
    answer = wait_for_store("127.0.0.1", port, 1.5)
    assert 1.5 <= time.monotonic() - started < 4
    assert (answer.kind, answer.said) == ("silent", "it accepted a connection but never answered as a rendezvous store")


def test_a_port_no_one_holds_answers_nothing_and_is_free():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert port_is_free(port)
    started = time.monotonic()
    assert wait_for_store("127.0.0.1", port, 1.0).kind == "nothing"
    assert time.monotonic() - started < 3


def test_the_launcher_reads_and_rewrites_the_rendezvous_conf():
    conf = "join_timeout=600,is_host=1"
    assert (conf_value(conf, "is_host"), join_timeout(conf), join_timeout("")) == ("1", 600, 600)
    assert with_join_timeout(conf, 42) == "is_host=1,join_timeout=42"
    assert hosts_the_store(conf, "far-away-host") == (True, True)
    assert hosts_the_store("is_host=0", "127.0.0.1") == (False, True)
