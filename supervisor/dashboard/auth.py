"""The secret that enables actions, sessions, and CSRF tokens.

Started without a secret, the dashboard is read-only: no action is shown, and every POST
of an action is refused (403). With one (``--token`` or ``QUEUE_DASHBOARD_TOKEN``), an
operator logs in by giving it once with a name (the "who" of the action log); the session
is a random id in an HttpOnly, SameSite=Strict cookie, kept in this process's memory only
(a restart logs everyone out). Each session has its own CSRF token, put in every action
form and required with every action POST, compared in constant time.
"""

from __future__ import annotations

import hmac
import secrets
import time
from dataclasses import dataclass

ENV_TOKEN = "QUEUE_DASHBOARD_TOKEN"
COOKIE = "queue_dashboard_session"
#: Seconds a session lasts from its login.
SESSION_SECONDS = 12 * 3600
#: Sessions kept at most (the oldest goes first): logins cannot fill the memory.
MAX_SESSIONS = 1000


@dataclass(frozen=True, slots=True)
class Session:
    who: str
    csrf: str
    until: float


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

    def logout(self, session_id: str | None) -> None:
        self._sessions.pop(session_id or "", None)

    def session(self, session_id: str | None) -> Session | None:
        session = self._sessions.get(session_id or "")
        if session is None or session.until < time.time():
            return None
        return session

    def check(self, session_id: str | None, csrf: str | None) -> tuple[Session | None, str]:
        """The session allowed to act, or None and why it is refused."""
        if self.read_only:
            return None, ("read-only: the dashboard was started without --token (or "
                          f"{ENV_TOKEN}), so it takes no action")
        session = self.session(session_id)
        if session is None:
            return None, "not logged in: actions need the dashboard's token (log in first)"
        if not csrf or not hmac.compare_digest(csrf.encode(), session.csrf.encode()):
            return None, ("the form's CSRF token is missing or wrong: reload the page and "
                          "try again (nothing was changed)")
        return session, ""
