"""The one exception type that reaches the user as a single line and a non-zero exit."""


class UserError(Exception):
    """Bad input or environment: the message says what is wrong and what to do."""


def one_line(exc: BaseException) -> str:
    """An exception's text folded onto one line, for embedding in a UserError."""
    return " ".join(str(exc).split()) or type(exc).__name__
