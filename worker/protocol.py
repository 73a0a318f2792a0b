"""The records exchanged on the rings between the supervisor and a handler process.

Every record starts with a 9-byte header: kind (u8) and delivery id (u64, 0 when the kind
has none), followed by a kind-specific body.

parent -> child: DELIVER (u8 flags, i64 attempts, then the raw envelope), CONFIRM
(1 byte: committed), EXIT. The attempts travel beside the envelope because a broker may count
them elsewhere (JetStream's delivery count): the envelope's own ``attempts`` field is only a
fallback. They are any signed 64-bit value, as any one is a valid ``attempts`` of an envelope
(PHP's ``int``, negative included), so "unknown" is the flag byte, not a reserved value.
DELIVER's flags: bit 0 (``KNOWN``) the attempts are known; bit 1 (``PLAIN``) the supervisor
found the envelope plain (``broker.envelope.decode_flagged``), so the handler process may
read it with ``orjson.loads`` alone. PLAIN is only sent with KNOWN (a process of an older
version read any non-zero flags as known), and a reader may ignore it: decoding the
envelope fully is always right, only slower (``decode`` below drops it).
child -> parent: READY (init() ran; no body: whether CONFIRM is wanted the supervisor knows
from the handler it loaded, the one the process inherited), STARTED, DONE (f64: seconds from
the handler's start to its return, a wait for ``flush()`` not included; older versions sent
none, read as 0), FAILED (a
``broker.failure.Failure`` record: class, message, where, traceback; older versions sent
UTF-8 error text, which still decodes), SKIPPED, INIT_FAILED (UTF-8 error text), and HELD
from a process running several deliveries at once (an ``async def`` handler): the handler
returned and the delivery waits for ``flush()``, so it is not a suspect when the process dies;
WITHDRAWN (u64: the delivery's number in its ring, see "Taking back" below).

STARTED comes only from a process running several deliveries at once. A plain ``def``
handler runs its ring's deliveries one at a time in ring order, so it sends no record when
one starts: it marks the delivery's number on its outcome ring (``Ring.mark``, one store in
shared memory) before the handler runs. The supervisor reads the mark when it needs to
know (a handler timeout, the process died, every watch period): the marked delivery and the
ones before it without an outcome are running. That halves the records per delivery.

Taking back (fair dispatch): deliveries are numbered per ring, 1 for the first DELIVER a
process reads from its ring, then 2 and so on (both sides count the DELIVER records, so no
number travels). Every process, plain or async, marks on its outcome ring the number of the
delivery it reached, *then* reads the supervisor's cut (the mark of its delivery ring): a
delivery numbered below the cut was taken back, so it neither starts nor is skipped but
reported WITHDRAWN (delivery id, u64 number). The supervisor takes back in the mirror order:
it writes the cut, then reads the mark. Each side stores, fences (``ring.fence``), then
loads, so at least one of them sees the other (Dekker): every delivery numbered above the
mark it read will find the cut and not start, and may be handed to another process at once;
those up to the mark either ran or come back WITHDRAWN (the process may pass several between
the supervisor's store of the cut and its read of the mark).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

from broker.failure import Failure

DELIVER = 1
CONFIRM = 2
EXIT = 3
READY = 10
STARTED = 11
DONE = 12
FAILED = 13
SKIPPED = 14
INIT_FAILED = 15
HELD = 16
WITHDRAWN = 17

KIND_NAMES = {
    DELIVER: "DELIVER", CONFIRM: "CONFIRM", EXIT: "EXIT", READY: "READY",
    STARTED: "STARTED", DONE: "DONE", FAILED: "FAILED", SKIPPED: "SKIPPED",
    INIT_FAILED: "INIT_FAILED", HELD: "HELD", WITHDRAWN: "WITHDRAWN",
}

#: Error texts are cut to this many UTF-8 bytes (a traceback must not fill the ring).
MAX_ERROR_BYTES = 4096
#: A FAILED record's failure is at most this many bytes (a smaller ring takes less: see
#: ``failure_body``); the traceback gives way first, keeping its end.
MAX_FAILURE_BYTES = 16384

_HEAD = struct.Struct("<BQ")
_ATTEMPTS = struct.Struct("<Bq")  # flags (KNOWN 0: take them from the envelope), attempts
_DELIVER_HEAD = struct.Struct("<BQBq")  # _HEAD and _ATTEMPTS in one pack
_DONE_HEAD = struct.Struct("<BQd")  # DONE: _HEAD and the handler's seconds
_WITHDRAWN = struct.Struct("<BQQ")  # WITHDRAWN: _HEAD and the delivery's number in its ring
_TEXT_KINDS = (FAILED, INIT_FAILED)
#: Kinds with nothing after the header (the ones a supervisor reads twice per delivery first).
_BARE_KINDS = frozenset((STARTED, DONE, EXIT, SKIPPED, HELD, READY))

#: Bytes a DELIVER record adds to its envelope.
DELIVER_OVERHEAD = _HEAD.size + _ATTEMPTS.size
#: A DELIVER record's head in one call, for a handler process's loop (one per job):
#: (kind, delivery id, flags, attempts); the envelope follows at DELIVER_OVERHEAD.
unpack_deliver = _DELIVER_HEAD.unpack_from
#: DELIVER's flags: the attempts are known; the envelope is plain (see above).
KNOWN = 1
PLAIN = 2
_KNOWN_PLAIN = KNOWN | PLAIN
_FLAGS_AT = _HEAD.size

Decoded = tuple[int, int, tuple[int | None, bytes] | Failure | str | bool | int | None]


def text_data(data: object) -> str:
    """The data ``decode`` returns for INIT_FAILED records: the error text (for FAILED, the
    failure's summary)."""
    if isinstance(data, Failure):
        return data.summary
    return data if isinstance(data, str) else ""


def failure_data(data: object) -> Failure:
    """The data ``decode`` returns for FAILED records: the failure."""
    if isinstance(data, Failure):
        return data
    return Failure.from_text(data if isinstance(data, str) else None)


def encode_deliver(
    delivery_id: int, raw: bytes, attempts: int | None = None, plain: bool = False
) -> bytes:
    """``plain``: ``raw`` is plain (``broker.envelope.decode_flagged``), sent only with
    known attempts. Raises ValueError for attempts outside signed 64-bit (``decode`` never
    yields one)."""
    if attempts is None:
        return _DELIVER_HEAD.pack(DELIVER, delivery_id, 0, 0) + raw
    if -(2**63) <= attempts < 2**63:
        flags = KNOWN | PLAIN if plain else KNOWN
        return _DELIVER_HEAD.pack(DELIVER, delivery_id, flags, attempts) + raw
    raise ValueError(f"attempts {attempts} is outside the signed 64-bit range")


def encode_delivers(deliveries: Iterable[tuple[int, bytes, int, bool]]) -> list[bytes]:
    """``encode_deliver(delivery_id, raw, attempts, plain)`` of each, attempts known: one
    call for a batch (the supervisor's dispatch, once per job). Raises ValueError as it."""
    pack = _DELIVER_HEAD.pack
    try:
        return [pack(DELIVER, delivery_id, _KNOWN_PLAIN if plain else KNOWN, attempts) + raw
                for delivery_id, raw, attempts, plain in deliveries]
    except struct.error:  # attempts outside signed 64-bit: say which, as encode_deliver does
        return [encode_deliver(*delivery) for delivery in deliveries]


def deliver_plain(record: bytes) -> bool:
    """A DELIVER record says its envelope is plain (``decode`` leaves that out)."""
    return bool(record[_FLAGS_AT] & PLAIN)


def encode_confirm(delivery_id: int, committed: bool) -> bytes:
    return _HEAD.pack(CONFIRM, delivery_id) + (b"\x01" if committed else b"\x00")


def encode_exit() -> bytes:
    return _HEAD.pack(EXIT, 0)


def encode_ready() -> bytes:
    return _HEAD.pack(READY, 0)


def encode_started(delivery_id: int) -> bytes:
    return _HEAD.pack(STARTED, delivery_id)


def encode_held(delivery_id: int) -> bytes:
    return _HEAD.pack(HELD, delivery_id)


def encode_done(delivery_id: int, seconds: float = 0.0) -> bytes:
    return _DONE_HEAD.pack(DONE, delivery_id, seconds)


def done_fields(record: bytes) -> tuple[int, float]:
    """A DONE record's (delivery id, handler's seconds: 0.0 from an older process)."""
    if len(record) < _DONE_HEAD.size:
        return _HEAD.unpack_from(record)[1], 0.0
    _, delivery_id, handler_seconds = _DONE_HEAD.unpack_from(record)
    return delivery_id, handler_seconds


def done_many(records: list[bytes]) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """``done_fields`` of several DONE records at once: (delivery ids, seconds)."""
    unpack = _DONE_HEAD.unpack_from
    try:
        _, ids, seconds = zip(*[unpack(record) for record in records], strict=True)
    except struct.error:  # one from an older process, without its seconds
        ids, seconds = zip(*[done_fields(record) for record in records], strict=True)
    return ids, seconds


def encode_failed(
    delivery_id: int, failure: Failure, limit: int = MAX_FAILURE_BYTES
) -> bytes:
    return _HEAD.pack(FAILED, delivery_id) + failure_body(failure, limit)


def failure_body(failure: Failure, limit: int = MAX_FAILURE_BYTES) -> bytes:
    """``failure.encode()`` in at most ``limit`` bytes (the traceback gives way first)."""
    return failure.encode_within(limit)


def encode_withdrawn(delivery_id: int, number: int) -> bytes:
    return _WITHDRAWN.pack(WITHDRAWN, delivery_id, number)


def encode_skipped(delivery_id: int) -> bytes:
    return _HEAD.pack(SKIPPED, delivery_id)


def encode_init_failed(error: str) -> bytes:
    return _HEAD.pack(INIT_FAILED, 0) + _error_bytes(error)


def decode(record: bytes) -> Decoded:
    """``(kind, delivery_id, data)``; ``data`` depends on the kind.

    DELIVER: ``(attempts or None, raw envelope)`` (``deliver_plain`` reads its PLAIN flag);
    CONFIRM: committed (bool); FAILED: the ``Failure`` (from the plain error text of an
    older version too); INIT_FAILED: the error text (str); WITHDRAWN: the delivery's number
    in its ring (int); every other kind: None.
    Raises ValueError for a record no encoder here produces.
    """
    kind, delivery_id = _HEAD.unpack_from(record)
    if kind in _BARE_KINDS:
        return kind, delivery_id, None
    if kind == DELIVER:
        flags, attempts = _ATTEMPTS.unpack_from(record, _HEAD.size)
        raw = record[DELIVER_OVERHEAD:]
        return kind, delivery_id, (attempts if flags & KNOWN else None, raw)
    if kind == FAILED:
        return kind, delivery_id, _failure(record[_HEAD.size :])
    if kind in _TEXT_KINDS:
        return kind, delivery_id, record[_HEAD.size :].decode("utf-8", "replace")
    if kind == CONFIRM:
        return kind, delivery_id, record[_HEAD.size :] == b"\x01"
    if kind == WITHDRAWN:
        return kind, delivery_id, _WITHDRAWN.unpack_from(record)[2]
    if kind not in KIND_NAMES:
        raise ValueError(f"unknown record kind {kind}")
    return kind, delivery_id, None


def _failure(body: bytes) -> Failure:
    """A failure record, or (from a handler process of an older version, during a rolling
    upgrade of a host) the plain error text it sent instead."""
    if body[:1] == b"{":
        try:
            return Failure.decode(body)
        except ValueError:
            pass
    return Failure.from_text(body.decode("utf-8", "replace"))


def _error_bytes(error: str) -> bytes:
    data = error.encode("utf-8", "replace")
    if len(data) > MAX_ERROR_BYTES:
        # Cut on a character boundary so the text still decodes cleanly.
        data = data[:MAX_ERROR_BYTES].decode("utf-8", "ignore").encode("utf-8")
    return data
