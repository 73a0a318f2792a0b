"""``check`` and ``drain`` on a NATS queue (issue 39.5): JetStream keeps no record of who
consumes, so supervisors of ours answer on ``queue-supervisor.alive.<stream>``
(``broker.nats.presence``). ``check`` fails naming host and pid while one answers; ``drain``
stops this host's, waits for the others and succeeds only once none answers. PHP workers
(the queue-5 model) and the operator commands' own connections never count."""

from __future__ import annotations

import asyncio
import os
import signal
import socket

import pytest

from support.nats_jobs import queue_exists
from support.supervision import QUEUE, write_config
from support.waiting import until
from tests.queue5_nats import Queue5NatsWorker

pytestmark = pytest.mark.slow  # every test here takes a second or more


async def test_check_and_drain_a_live_supervisor_beside_a_php_worker(
    tmp_path, nats_server, supervisors, run
):
    config = str(write_config(tmp_path, nats_server.url, handler="examples.noop:handle"))
    supervisor = supervisors(config)
    await until(lambda: queue_exists(nats_server), 20, "the queue")
    php = await Queue5NatsWorker(nats_server.url, QUEUE).connect(mode="adopt")
    try:
        code, out = await run("check", config)
        assert code == 1, out
        assert f"    host {socket.gethostname()} pid {supervisor.pid}" in out
        code, out = await run("drain", config, "--timeout", "30")
        assert code == 0, out
        assert f"stopping 1 supervisors of {QUEUE}: pids {supervisor.pid}" in out
        assert f"ok: no supervisor of ours answers on {QUEUE} (NATS)" in out
        assert supervisor.process.poll() == 0, supervisor.output()
        code, out = await run("check", config)  # the PHP worker is not ours
        assert code == 0 and out.startswith("ok:"), out
    finally:
        await php.close()


async def test_only_a_supervisors_broker_answers_and_drain_waits_for_it(
    tmp_path, nats_server, nats_brokers, run
):
    config = str(write_config(tmp_path, nats_server.url, handler="examples.noop:handle"))
    await nats_brokers(QUEUE)  # an operator command's broker (publish): silent
    code, out = await run("check", config)
    assert code == 0 and out.startswith("ok:"), out
    ours = await nats_brokers(QUEUE, announce=True)  # as the supervisor makes it
    code, out = await run("check", config)
    assert code == 1 and f"    host {socket.gethostname()} pid {os.getpid()}" in out, out
    # It cannot stop this process (never itself): it waits, then says who still runs.
    code, out = await run("drain", config, "--timeout", "3")
    assert code == 1 and "not empty" in out and f"pid {os.getpid()}" in out, out
    draining = asyncio.ensure_future(run("drain", config, "--timeout", "30"))
    await asyncio.sleep(3)  # drain asks (2 s) and finds it alive: a margin, not a condition
    assert not draining.done()  # it cannot end while this one answers
    await ours.close()  # it stops meanwhile
    code, out = await draining
    assert code == 0 and "ok: no supervisor of ours answers" in out, out


async def test_a_killed_supervisor_stops_answering_at_once(tmp_path, nats_server, supervisors,
                                                          run):
    """Unlike a Redis record, nothing outlives a NATS supervisor: killed, it answers no more
    (JetStream redelivers what it held after the ack wait)."""
    config = str(write_config(tmp_path, nats_server.url, handler="examples.noop:handle"))
    supervisor = supervisors(config)
    await until(lambda: queue_exists(nats_server), 20, "the queue")
    code, _ = await run("check", config)
    assert code == 1
    for process in supervisor.family():
        process.send_signal(signal.SIGKILL)
    supervisor.wait(10)
    code, out = await run("check", config)
    assert code == 0, out
