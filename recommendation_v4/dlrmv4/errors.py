"""The one exception type that reaches the user as a single line and a non-zero exit, and how a
rank's line reaches the launcher (``dlrmv4.launch``) that says the job's last line."""

import json
import os
import sys
import time

ERROR_PREFIX = "[dlrmv4] error: "
# Set by dlrmv4.launch for the ranks it starts: it says the job's one line about a stop, so they leave
# the SIGTERM that stops them unsaid.
LAUNCHER_ENV = "DLRMV4_LAUNCHER"
# Where torchrun's agent reads a failed worker's message (one file per rank, named in its environment).
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
CAUSED_BY_ANOTHER_RANK = "dlrmv4_caused_by_another_rank"


class UserError(Exception):
    """Bad input or environment: the message says what is wrong and what to do."""

    caused_by_another_rank = False  # a rank's failure that only follows another rank's


def under_launcher() -> bool:
    return os.environ.get(LAUNCHER_ENV) == "1"


def leave_for_launcher(line: str, caused_by_another_rank: bool = False) -> bool:
    """Write this rank's one-line failure where torchrun's agent reads it, once: the first line a rank
    leaves is its cause (nothing without a launcher; best effort: the report must never mask the
    failure). True when the launcher has a line of this rank's."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return False
    record = {"message": line, "timestamp": int(time.time()), CAUSED_BY_ANOTHER_RANK: caused_by_another_rank}
    try:
        with open(path, "x") as fh:
            json.dump(record, fh)
    except FileExistsError:
        return True
    except OSError:
        return False
    return True


def one_line(exc: BaseException) -> str:
    """An exception's text folded onto one line, for embedding in a UserError."""
    return " ".join(str(exc).split()) or type(exc).__name__


def report_failure(line: str, caused_by_another_rank: bool = False) -> None:
    """The one error line: where a launcher reads it, and on stderr unless dlrmv4.launch (which says
    the job's one line) has it; in one write, since ranks started unbuffered share a console."""
    if leave_for_launcher(line, caused_by_another_rank) and under_launcher():
        return
    sys.stderr.write(ERROR_PREFIX + line + "\n")
    sys.stderr.flush()


def exit_with_error(message: str, linger_seconds: float = 0.0) -> None:
    """Report the one error line and end the process now, from any thread: for a thread that must end
    a run whose main thread is blocked in native code (a collective that will never complete) because
    another rank failed. ``linger_seconds``: stay that long first (a process whose exit takes the
    rendezvous store, which the other ranks still read, with it)."""
    report_failure(message, caused_by_another_rank=True)
    sys.stdout.flush()
    time.sleep(linger_seconds)
    os._exit(1)
