"""How an exception reads in one log line or error message: the one spelling for the
supervisor, the brokers and the handler processes.

It sits at the bottom of the project (it imports nothing of it), so any module may use it
without an import circle.
"""

from __future__ import annotations


def describe(error: BaseException) -> str:
    """``Type: message``, or the type alone when the message is empty (``TimeoutError()``
    would otherwise read as ``TimeoutError: ``)."""
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
