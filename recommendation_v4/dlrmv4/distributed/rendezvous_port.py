"""What answers at a rendezvous address, asked the way a c10d store is asked: the launcher and the
ranks started without one check the port before torch's own waits there, which run in native code
that neither the join timeout nor a SIGTERM reaches.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import os
import signal
import socket
import struct
import threading
import time
from dataclasses import dataclass

# c10d's TCPStore protocol (QueryType and the magic number in torch's c10d/TCPStoreBackend.hpp): a
# client first sends VALIDATE with the magic number; PING then has the store send back the nonce it
# carries. Whatever else holds the port answers otherwise, or not at all.
_STORE_VALIDATE, _STORE_PING, _STORE_MAGIC = 0, 13, 0x3C85F7CE
_PROBE_NONCE = 0x6D726C64  # no newline byte: a line-based server (HTTP) keeps waiting, it does not answer
STORE_PROBE_SECONDS = 2.0  # a store answers a ping within milliseconds
STORE_RETRY_SECONDS = 0.5


@dataclass(frozen=True)
class PortAnswer:
    """What is at a rendezvous address: ``"store"`` (a c10d store answered), ``"nothing"`` (refused,
    unreachable), ``"silent"`` (a program that took the connection but gave no store's answer) or
    ``"other"`` (a program that answered otherwise); ``said``: how, for the line."""

    kind: str
    said: str = ""


def probe_port(addr: str, port: int, seconds: float = STORE_PROBE_SECONDS) -> PortAnswer:
    """Ask ``addr:port`` for a store's answer to a ping, waiting up to ``seconds`` for each step."""
    try:
        conn = socket.create_connection((addr, port), timeout=seconds)
    except OSError:
        return PortAnswer("nothing")
    with conn:
        try:
            conn.sendall(struct.pack("=BIBI", _STORE_VALIDATE, _STORE_MAGIC, _STORE_PING, _PROBE_NONCE))
            answer = b""
            while len(answer) < 4:
                chunk = conn.recv(64)
                if not chunk:
                    return PortAnswer("silent", "it closed the connection without answering as a rendezvous store")
                answer += chunk
        except socket.timeout:
            return PortAnswer("silent", "it accepted a connection but never answered as a rendezvous store")
        except OSError as exc:
            return PortAnswer("silent", f"it broke the connection ({exc.strerror or exc})")
    if struct.unpack("=I", answer[:4])[0] == _PROBE_NONCE:
        return PortAnswer("store")
    text = " ".join(answer.decode("ascii", "replace").split())[:60]
    return PortAnswer("other", f"it answered {text!r}")


def wait_for_store(addr: str, port: int, seconds: float) -> PortAnswer:
    """Probe ``addr:port`` until a store answers, another program answers something, or ``seconds``
    have passed (the last answer then: nothing, or a program silent as a store)."""
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        answer = probe_port(addr, port, max(min(STORE_PROBE_SECONDS, left), 0.1))
        if answer.kind in ("store", "other"):
            return answer
        left = deadline - time.monotonic()
        if left <= 0:
            return answer
        time.sleep(min(STORE_RETRY_SECONDS, left))


def port_is_free(port: int) -> bool:
    """Whether this machine can listen on ``port``, as a c10d store does (every address, the same
    SO_REUSEADDR: a port left in TIME_WAIT by an earlier run is free)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as exc:
            return exc.errno != errno.EADDRINUSE
    return True


def port_held_line(addr: str, port: int, answer: PortAnswer) -> str:
    """The line for a rendezvous port that another program holds."""
    said = (
        "it answers as a rendezvous store: another job's, or an earlier run's still going"
        if answer.kind == "store"
        else answer.said
    )
    return (
        f"MASTER_PORT {port} on {addr} is held by another program{f' ({said})' if said else ''}: stop it, or "
        "give every node another MASTER_PORT"
    )


# The key under which the node that would host the store leaves its refusal of a port that another
# store (a stale one: an earlier attempt's) holds, for the nodes that joined that store instead.
REFUSAL_KEY = "dlrmv4/port_refused"
REFUSAL_POLL_SECONDS = 1.0
STORE_CLIENT_SECONDS = 5.0


def _store_client(host: str, port: int):
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=STORE_CLIENT_SECONDS))


def leave_refusal(host: str, port: int, line: str) -> None:
    """Leave the hosting node's refusal in the store that holds its port (best effort)."""
    with contextlib.suppress(Exception):
        _store_client(host, port).set(REFUSAL_KEY, line)


def _refusal_in(store) -> str | None:
    return store.get(REFUSAL_KEY).decode() if store.check([REFUSAL_KEY]) else None


def read_refusal(host: str, port: int) -> str | None:
    """The refusal a hosting node left in the store at ``host:port``, if any."""
    with contextlib.suppress(Exception):
        return _refusal_in(_store_client(host, port))
    return None


class RefusalWatch:
    """While this node waits in torchrun's rendezvous (in native code no exception reaches), watch the
    store for the hosting node's refusal of the port; on one, keep its line and stop this process with
    SIGTERM, whose handler ends the wait. Ends by itself after ``seconds`` (the join timeout)."""

    def __init__(self, host: str, port: int, seconds: float) -> None:
        self.host, self.port = host, port
        self.line: str | None = None  # the refusal, once read
        self._stop = threading.Event()
        self._until = time.monotonic() + seconds
        self._thread = threading.Thread(target=self._watch, name="dlrmv4-refusal-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        store = None  # one connection for the whole watch, made again only if it breaks
        while not self._stop.wait(REFUSAL_POLL_SECONDS) and time.monotonic() < self._until:
            refused = None
            try:
                store = store or _store_client(self.host, self.port)
                refused = _refusal_in(store)
            except Exception:  # noqa: BLE001 - the store not answering yet (or any more) is no refusal
                store = None
            if refused is not None:
                self.line = refused
                os.kill(os.getpid(), signal.SIGTERM)
                return

    def stop(self) -> None:
        self._stop.set()


def stale_store_line(refusal: str) -> str:
    return f"the store at the rendezvous port is not the run's: {refusal}"
