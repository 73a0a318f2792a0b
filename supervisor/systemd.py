"""systemd ``Type=notify`` support: READY, STATUS, WATCHDOG and STOPPING datagrams.

systemd passes the path of its notification socket in ``NOTIFY_SOCKET`` (a leading ``@``
names an abstract socket). Each message is one datagram of ``KEY=value`` lines; nothing
else is needed, so there is no dependency on python-systemd. Without ``NOTIFY_SOCKET``
every call does nothing, so the supervisor runs the same in a terminal.

A notification must never stop the supervisor: send errors are logged once and dropped,
and the socket is non-blocking so a slow systemd cannot stall the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Mapping, MutableMapping

log = logging.getLogger("supervisor.systemd")

#: STATUS is refreshed this often (s) when systemd asks for no watchdog pings.
STATUS_PERIOD = 5.0


class Notifier:
    """Sends notifications to ``address`` (None: a no-op notifier)."""

    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        self.address = address
        #: Seconds between watchdog pings (half of WatchdogSec), or None without a watchdog.
        self.watchdog_interval = watchdog_usec / 2e6 if watchdog_usec else None
        self._socket: socket.socket | None = None
        self._failed = False

    @classmethod
    def from_environ(
        cls, environ: MutableMapping[str, str] = os.environ, unset: bool = True
    ) -> Notifier:
        """A notifier for the socket systemd named, if any.

        ``unset`` removes ``NOTIFY_SOCKET`` and the watchdog variables from ``environ``, so
        that processes forked later (handlers) cannot speak for the supervisor.
        """
        address = environ.get("NOTIFY_SOCKET") or None
        interval = watchdog_usec(environ)
        if unset:
            for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
                environ.pop(name, None)
        return cls(address, interval)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def ready(self) -> bool:
        """Start-up is complete: connected and every handler process is ready."""
        return self.notify("READY=1")

    def status(self, text: str) -> bool:
        """A one-line status that ``systemctl status`` shows."""
        return self.notify("STATUS=" + " ".join(text.split()))

    def watchdog(self) -> bool:
        """The event loop is alive (send every ``watchdog_interval`` seconds)."""
        return self.notify("WATCHDOG=1")

    def stopping(self) -> bool:
        """The graceful stop began."""
        return self.notify("STOPPING=1")

    def notify(self, *lines: str) -> bool:
        """Send one datagram; True if it was sent (False when disabled or on an error)."""
        if self.address is None:
            return False
        try:
            self._connected().sendto("\n".join(lines).encode(), _sockaddr(self.address))
        except OSError as error:
            if not self._failed:  # once: a broken socket would otherwise log every period
                log.warning("systemd notification to %s failed: %s", self.address, error)
                self._failed = True
            return False
        return True

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    def _connected(self) -> socket.socket:
        if self._socket is None:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._socket.setblocking(False)
        return self._socket


def watchdog_usec(environ: Mapping[str, str] = os.environ) -> int | None:
    """``WATCHDOG_USEC`` if the watchdog is meant for this process, else None."""
    try:
        usec = int(environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    pid = environ.get("WATCHDOG_PID")
    if usec <= 0 or (pid and pid != str(os.getpid())):
        return None
    return usec


def watchdog_interval(environ: Mapping[str, str] = os.environ) -> float | None:
    """Seconds between watchdog pings: half of ``WATCHDOG_USEC``; None without a watchdog."""
    usec = watchdog_usec(environ)
    return usec / 2e6 if usec else None


def status_text(outstanding: int, prefetch: int, jobs_per_second: float) -> str:
    return f"buffer {outstanding}/{prefetch}, {jobs_per_second:.0f} jobs/s"


async def keepalive(notifier: Notifier, status: Callable[[], str]) -> None:
    """Send STATUS and WATCHDOG from the event loop until cancelled.

    Run as a task of the loop itself: a blocked loop stops the pings, and systemd then
    restarts the service (a side thread would keep pinging a stuck loop).
    """
    if not notifier.enabled:
        return
    period = notifier.watchdog_interval or STATUS_PERIOD
    while True:
        notifier.status(status())
        if notifier.watchdog_interval:
            notifier.watchdog()
        await asyncio.sleep(period)


def _sockaddr(address: str) -> str | bytes:
    """A leading '@' names an abstract socket: its first byte is NUL."""
    if address.startswith("@"):
        return b"\0" + address[1:].encode()
    return address
