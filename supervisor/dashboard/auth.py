"""The secret that guards the pages and enables actions, sessions, CSRF and one-time action
tokens.

Started without a secret, the dashboard is read-only: no action is shown, every POST of an
action is refused (403), and every page says that its job data is readable by whoever
reaches the port. With one (``--token`` or ``QUEUE_DASHBOARD_TOKEN``), every page and live
fragment needs a session (``/healthz``, ``/login`` and the static files excepted): an
operator logs in by giving the secret once with a name (the "who" of the action log); the
session is a random id in an HttpOnly, SameSite=Strict cookie, kept in this process's
memory only (a restart logs everyone out). Each session has its own CSRF token, put in every
action form and required with every action POST, compared in constant time.

Every action form also carries a one-time action token (``issue``, spent by ``check``): a
form posted twice (a double click, a reload of the answer, a second tab of the same page)
acts once, and the repeat is refused with nothing done. A page mints one token per
rendering, shared by its forms: after one of them acted, the others of that rendering are
void too (the answer page links back to a fresh one). Any new action gets the same
protection by putting ``macros.html``'s ``action_fields`` in its form and calling ``check``
with the form's ``once``; a bulk action's confirmation also keeps the confirmed set under
that token (``bulk.Plans``).
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from urllib.parse import urlsplit

ENV_TOKEN = "QUEUE_DASHBOARD_TOKEN"
COOKIE = "queue_dashboard_session"
#: Seconds a session lasts from its login.
SESSION_SECONDS = 12 * 3600
#: Sessions kept at most (the oldest goes first): logins cannot fill the memory.
MAX_SESSIONS = 1000
#: One-time action tokens kept per session (the oldest goes first: a page rendered that
#: many renderings ago has to be loaded again to act).
MAX_ONCE = 2000
#: Seconds a one-time action token stays valid after its page was rendered.
ONCE_SECONDS = 900


@dataclass(slots=True)
class Session:
    who: str
    csrf: str
    until: float
    #: one-time action tokens not spent yet -> until when they are valid
    once: OrderedDict[str, float] = field(default_factory=OrderedDict)


class Guard:
    def __init__(self, token: str | None) -> None:
        self._token = token or None
        self._sessions: dict[str, Session] = {}

    @property
    def read_only(self) -> bool:
        return self._token is None

    def login(self, token: str, who: str) -> str | None:
        """A new session id if ``token`` is the secret, else None."""
        if self._token is None or not hmac.compare_digest(token.encode(), self._token.encode()):
            return None
        while len(self._sessions) >= MAX_SESSIONS:
            del self._sessions[next(iter(self._sessions))]
        session_id = secrets.token_urlsafe(32)
        self._sessions[session_id] = Session(who[:64] or "anonymous", secrets.token_urlsafe(32),
                                             time.time() + SESSION_SECONDS)
        return session_id

    def logout(self, session_id: str | None, csrf: str | None) -> bool:
        """End the session, if ``csrf`` is its CSRF token (another site cannot log one out);
        whether it ended."""
        session = self.session(session_id)
        if session is None or not hmac.compare_digest((csrf or "").encode(),
                                                      session.csrf.encode()):
            return False
        self._sessions.pop(session_id or "", None)
        return True

    def session(self, session_id: str | None) -> Session | None:
        session = self._sessions.get(session_id or "")
        if session is None or session.until < time.time():
            return None
        return session

    def may_read(self, session_id: str | None) -> bool:
        """Whether a request may see job data: anyone without a token, else a session."""
        return self.read_only or self.session(session_id) is not None

    def issue(self, session_id: str | None) -> str:
        """A new one-time action token of the session ("" without one)."""
        session = self.session(session_id)
        if session is None:
            return ""
        now = time.time()
        # oldest first, all with the same lifetime: the lapsed ones are at the front
        while session.once and (len(session.once) >= MAX_ONCE
                                or next(iter(session.once.values())) < now):
            session.once.popitem(last=False)
        once = secrets.token_urlsafe(24)
        session.once[once] = now + ONCE_SECONDS
        return once

    def check(self, session_id: str | None, csrf: str | None, once: str | None
              ) -> tuple[Session | None, str]:
        """The session allowed to act, or None and why it is refused. A passing check spends
        ``once``: the same form cannot act twice."""
        if self.read_only:
            return None, ("read-only: the dashboard was started without --token (or "
                          f"{ENV_TOKEN}), so it takes no action")
        session = self.session(session_id)
        if session is None:
            return None, "not logged in: actions need the dashboard's token (log in first)"
        if not csrf or not hmac.compare_digest(csrf.encode(), session.csrf.encode()):
            return None, ("the form's CSRF token is missing or wrong: reload the page and "
                          "try again (nothing was changed)")
        until = session.once.pop(once or "", None)
        if until is None or until < time.time():
            return None, ("this form was sent already (a double click, a reload, or another "
                          "tab of the same page) or is too old: nothing was done now. "
                          "Reload the page to see where things stand and act again")
        return session, ""


def local_target(target: str | None) -> str:
    """Where to go after the login: a path of this dashboard, never another site."""
    if not target:
        return "/"
    parts = urlsplit(target)
    if (parts.scheme or parts.netloc or not target.startswith("/") or target.startswith("//")
            or "\\" in target or any(ord(c) < 32 for c in target)):
        return "/"
    return target
