"""Who takes the blame when a handler process dies with deliveries started in it.

A blamed delivery counts a "worker lost" attempt (retried, or failed/dead at max_attempts),
so a message that kills its process ends in failed/dead instead of crash-looping; the
others run again with their attempts unchanged.

One delivery at a time (a plain ``def`` handler): the newest started was in the handler
and takes the blame; the older ones had returned and waited for ``flush()``.

Several at once (an ``async def`` handler, whose process reports HELD when a handler
returned), by what killed the process:

- our kill for a handler timeout: only the deliveries past their time; the others were
  innocent bystanders of the kill.
- anything else (a crash, the OOM killer, a stray SIGKILL): every delivery whose handler
  had not returned. Any of them may have caused it and nothing tells which; blaming only
  one would let a message that kills its process beside others run forever. The cost is an
  attempt for the bystanders. Returned ones (HELD) are never blamed then.
- nothing was still in a handler: the process died in ``flush()`` (or between), and the
  deliveries it covered take the blame, as a raising ``flush()`` fails them.
"""

from __future__ import annotations

from supervisor.buffer import Entry


def blamed(running: list[Entry], *, concurrent: bool, overdue: set[int]) -> list[Entry]:
    """The blamed ones of the deliveries running (in start order) in a dead process; the
    others run again. ``Entry.held``: the process reported that its handler returned."""
    if not concurrent:
        return running[-1:]
    if overdue:
        return [entry for entry in running if entry.id in overdue]
    in_handler = [entry for entry in running if not entry.held]
    return in_handler or running
