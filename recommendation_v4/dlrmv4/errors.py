"""The one exception type that reaches the user as a single line and a non-zero exit."""

import os
import sys

ERROR_PREFIX = "[dlrmv4] error: "


class UserError(Exception):
    """Bad input or environment: the message says what is wrong and what to do."""


def one_line(exc: BaseException) -> str:
    """An exception's text folded onto one line, for embedding in a UserError."""
    return " ".join(str(exc).split()) or type(exc).__name__


def exit_with_error(message: str) -> None:
    """Print the one error line and end the process now, from any thread: for a thread that must end
    a run whose main thread is blocked in native code (a collective that will never complete)."""
    print(ERROR_PREFIX + message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)
