"""Dead letters made and read by tests of a NATS queue."""

from __future__ import annotations

from broker import envelope
from broker.base import Action, Settlement
from broker.nats.setup import QueueNames
from support.brokers import receive_all
from support.supervision import QUEUE

NAMES = QueueNames.of(QUEUE)


async def bury(nats_brokers, count: int) -> tuple[object, list[str]]:
    """``count`` jobs rejected at max_attempts = 1 by the real broker: dead letters 1..n."""
    broker = await nats_brokers(QUEUE, max_attempts=1)
    pids = [await broker.publish(QUEUE, {"n": n}) for n in range(count)]
    deliveries = await receive_all(broker, count)
    await broker.settle([Settlement(Action.REJECT, d, f"boom {d.pid}") for d in deliveries])
    return broker, pids


async def dead_pids(js) -> list[str]:
    """The pids in the dead stream, oldest first."""
    info = await js.stream_info(NAMES.dead_stream)
    found, seq = [], info.state.first_seq
    while info.state.messages and seq <= info.state.last_seq:
        try:
            msg = await js.get_msg(NAMES.dead_stream, seq=seq, subject=NAMES.dead_subject,
                                   next=True)
        except Exception:
            break
        found.append(envelope.decode(msg.data)["pid"])
        seq = msg.seq + 1
    return found


async def work_messages(js) -> int:
    return (await js.stream_info(NAMES.stream)).state.messages
