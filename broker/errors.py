"""How an exception reads in one log line or error message: the one spelling for the
supervisor, the brokers and the handler processes.

It sits at the bottom of the project (it imports nothing of it), so any module may use it
without an import circle.
"""

from __future__ import annotations

#: Characters of an error's message kept in a line (a handler may raise a 10 MB one).
MAX_TEXT = 2000
#: The end of uvloop's message for any operation on a closed handle.
_CLOSED_HANDLE = "the handler is closed"


def describe(error: BaseException) -> str:
    """``Type: message``, or the type alone when the message is empty (``TimeoutError()``
    would otherwise read as ``TimeoutError: ``). Never raises, and never longer than a
    line should be, whatever the exception's ``__str__`` does (a handler's own class)."""
    try:
        text = str(error)
    except Exception as broken:  # the log line of a failure must not fail in its turn
        text = f"<str() raised {type(broken).__name__}>"
    if len(text) > MAX_TEXT:
        text = f"{text[:MAX_TEXT]}... [cut: {len(text):,} characters]"
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def closed_transport(error: BaseException) -> bool:
    """Whether ``error`` is uvloop refusing an operation on a transport that is already
    closed (``RuntimeError: unable to perform operation on <TCPTransport closed=True ...>;
    the handler is closed``): a lost connection, where asyncio's own loop drops the write and
    the read then fails."""
    return isinstance(error, RuntimeError) and _CLOSED_HANDLE in str(error)
