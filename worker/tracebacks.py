"""A handler's traceback as the failure record keeps it: cheap enough to make on every
failed run of a failure storm, and about the handler, not our loop.

``traceback.format_exception`` costs about a millisecond for a few frames on Python 3.11
(it stats every file and parses each line to place its ``^^^`` markers): a handler process
whose every job fails for a minute (a database down) would spend more time on tracebacks
than on jobs. This one writes the classic lines (file, line, function, the source line),
keeps the last ``MAX_FRAMES`` frames of each exception, follows ``__cause__`` and
``__context__`` a few levels, and starts at the handler's frame (the frames of this package
above it are our delivery loop).
"""

from __future__ import annotations

import asyncio
import collections
import linecache
import os
import traceback
import types

#: Frames kept per exception (the innermost ones: a RecursionError has a thousand); about
#: what the record's 8 KB of traceback holds, so the note of what was left out stays in it.
MAX_FRAMES = 50
#: Chained exceptions followed (``raise ... from``, or raised while handling another).
MAX_CHAIN = 5

_OURS = os.path.dirname(os.path.abspath(__file__)) + os.sep
#: Where asyncio's own frames live (``where`` of a timeout looks past them).
ASYNCIO = os.path.dirname(os.path.abspath(asyncio.__file__)) + os.sep
_CAUSE = "\nThe above exception was the direct cause of the following exception:\n\n"
_CONTEXT = "\nDuring handling of the above exception, another exception occurred:\n\n"


def format_failure(error: BaseException) -> str:
    """The traceback of ``error`` and of what it was chained to, as Python prints it (less
    the position markers); never raises."""
    try:
        return "".join(_lines(error, set(), top=True))
    except Exception:  # a broken exception or frame: the class and message are kept anyway
        return ""


def where(error: BaseException, beside: tuple[str, ...] = ()) -> str:
    """``path.py:12 in handle``: the innermost frame of the error's traceback ("" if none),
    or the innermost one outside the folders ``beside`` (a cancelled handler's await, not
    asyncio's sleep where the cancellation landed)."""
    found = None
    for frame, number in traceback.walk_tb(error.__traceback__):
        if found is None or not frame.f_code.co_filename.startswith(beside or ("\0",)):
            found = frame, number
    if found is None:
        return ""
    frame, number = found
    return f"{frame.f_code.co_filename}:{number} in {frame.f_code.co_name}"


def from_the_handler(frames: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback from its first frame outside this package on (the handler's call)."""
    while (frames is not None and frames.tb_next is not None
           and frames.tb_frame.f_code.co_filename.startswith(_OURS)):
        frames = frames.tb_next
    return frames


def _lines(error: BaseException, seen: set[int], top: bool = False) -> list[str]:
    seen.add(id(error))
    lines: list[str] = []
    cause = error.__cause__
    context = None if error.__suppress_context__ else error.__context__
    chained = cause if cause is not None else context
    if chained is not None and id(chained) not in seen and len(seen) <= MAX_CHAIN:
        lines += _lines(chained, seen)
        lines.append(_CAUSE if cause is not None else _CONTEXT)
    frames = error.__traceback__
    if top:
        frames = from_the_handler(frames)
    if frames is not None:
        lines.append("Traceback (most recent call last):\n")
        kept = collections.deque(traceback.walk_tb(frames), maxlen=MAX_FRAMES)
        skipped = sum(1 for _ in traceback.walk_tb(frames)) - len(kept)
        if skipped:
            lines.append(f"  [{skipped} outer frames not shown]\n")
        for frame, number in kept:
            code = frame.f_code
            lines.append(f'  File "{code.co_filename}", line {number}, in {code.co_name}\n')
            source = linecache.getline(code.co_filename, number).strip()
            if source:
                lines.append(f"    {source}\n")
    lines += traceback.format_exception_only(type(error), error)
    return lines
