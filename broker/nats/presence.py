"""How ``check`` and ``drain`` tell that supervisors of ours are alive on a NATS queue.

JetStream keeps no record of who consumes: a pull request names no worker, and consumer
info counts waiting pulls and unacknowledged deliveries of PHP workers and supervisors
alike. So every supervisor (only a supervisor: not the operator commands, which open a
broker too) subscribes on each of its connections to ``queue-supervisor.alive.<stream>``,
with no queue group, and answers every request there with ``"<host> <pid>"``, as the
Redis record says. ``ask`` sends one request and gathers the answers for a few seconds.

The subject is outside ``q.<name>.>`` on purpose: a work stream may capture more subjects
than queue 5's two (the consumer filters), and a request there would be stored as a job.
A supervisor whose NATS user may not subscribe there, or one frozen (SIGSTOP) for longer
than the wait, does not answer: ``check`` then says so only through the consumer's counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from typing import Any

from nats.aio.msg import Msg

#: Seconds ``ask`` gathers answers (each supervisor answers from its event loop).
WAIT = 2.0


def subject(stream: str) -> str:
    return f"queue-supervisor.alive.{stream}"


def whoami() -> bytes:
    return f"{socket.gethostname()} {os.getpid()}".encode()


class Answerer:
    """Answers the presence requests of one queue, on every connection it is given."""

    def __init__(self, stream: str) -> None:
        self.subject = subject(stream)
        self._me = whoami()
        self._replies: set[asyncio.Task[None]] = set()  # kept until sent (the loop's refs are weak)

    async def listen(self, conn: Any) -> None:
        """Subscribe on ``conn`` (a ``broker.nats.conn.Connection``); ends with it."""
        await conn.subscribe(self.subject, lambda msg: self._answer(conn, msg), queue="")

    def _answer(self, conn: Any, msg: Msg) -> None:
        if not msg.reply:
            return
        task = asyncio.get_running_loop().create_task(self._send(conn, msg.reply))
        self._replies.add(task)
        task.add_done_callback(self._replies.discard)

    async def _send(self, conn: Any, reply: str) -> None:
        with contextlib.suppress(Exception):  # a connection closing meanwhile: asked again
            await conn.publish(reply, self._me)


async def ask(client: Any, stream: str, wait: float = WAIT) -> list[str]:
    """The ``"<host> <pid>"`` of every supervisor of ours that answered within ``wait``
    seconds (``client``: a connected nats-py client), sorted, each once."""
    inbox = client.new_inbox()
    answers: set[str] = set()
    sub = await client.subscribe(inbox)
    try:
        await client.publish(subject(stream), b"", reply=inbox)
        await client.flush()
        deadline = time.monotonic() + wait
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = await sub.next_msg(timeout=left)
            except TimeoutError:
                break
            if msg.data:  # an empty one is the server's "no responders" status
                answers.add(msg.data.decode(errors="replace"))
    finally:
        await sub.unsubscribe()
    return sorted(answers)
