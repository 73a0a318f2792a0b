"""The dashboard's pages (Starlette) and its sampler.

Pages are rendered by Jinja2 with autoescape on, and every text read from a broker passes
the ``show`` filter first, which writes control and bidirectional characters as visible
``\\uNNNN`` (``logs.escape``) and cuts long values: HTML escaping alone would let a pid with
U+202E reorder what the operator reads. The Content-Security-Policy allows scripts from
this server's /static only, so even a bug in escaping could not run a message's script.

Live parts of a page (``data-live`` elements) are fetched again every ``refresh`` seconds
by static/live.js and swapped in as rendered here: no JavaScript library, no build step.

With a token every page and live fragment shows job data only to a session (``auth``):
without one a page answers a redirect to the login (which comes back to it), a live
fragment 401 (live.js then stops and says so). ``/healthz``, ``/login`` and the static files
are open. A job is named only by a pid of the producers' shape (``pids``).

The failed, dead and poison pages also search by error class, message and payload text,
bounded (``search``); what a search of failed or dead jobs matched can be retried or
deleted in bulk through a confirmation page whose form does exactly the set it showed, once
(``bulk``). A single delete is confirmed on a page of its own first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote

import jinja2
import nats.errors
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from broker.base import BrokerError
from supervisor import logs
from supervisor.config import Config
from supervisor.dashboard import actions, bulk, compare, pids, plots, scrape, search
from supervisor.dashboard.auth import COOKIE, SESSION_SECONDS, Guard, local_target
from supervisor.dashboard.history import History
from supervisor.dashboard.sources import (
    DETAIL_REUSE,
    LISTS,
    NATS_SEARCH_DEPTH,
    NatsSource,
    RedisSource,
    make_source,
)
from supervisor.figures import RateBook

log = logging.getLogger("supervisor.dashboard")

HERE = Path(__file__).resolve().parent
#: Characters of a message-derived value shown in a table cell (the job page shows more).
CELL = 200
#: Maintenance intervals a delayed retry may be overdue before it is shown as unattended.
OVERDUE_INTERVALS = 3
#: Bytes of a form body read at most.
MAX_FORM = 16 * 1024
#: Security headers of every answer.
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "img-src 'self'; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; "
    "base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}


@dataclass
class Queue:
    index: int
    config: Config
    source: RedisSource | NatsSource
    history: History = field(default_factory=History)
    #: The last queue page reading (monotonic time, detail), reused for DETAIL_REUSE s.
    last_detail: tuple[float, dict[str, Any]] | None = None
    detail_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: Each supervisor's figures as sampled, for its rates (``compare``; Redis).
    rates: RateBook = field(default_factory=RateBook)

    @property
    def name(self) -> str:
        return self.config.job.queue

    @property
    def broker(self) -> str:
        return self.config.broker.safe_url  # never with credentials

    @property
    def overdue_after(self) -> float:
        """Seconds a delayed retry may be overdue before the state column says so: every
        supervisor's maintenance moves what is due once per interval."""
        return OVERDUE_INTERVALS * self.config.supervisor.maintenance_interval


class Dashboard:
    def __init__(self, configs: list[Config], token: str | None, interval: float = 5.0,
                 refresh: float = 5.0, allowed_hosts: list[str] | None = None) -> None:
        """``allowed_hosts``: the names a request's Host header may give (None: any)."""
        self.queues = [Queue(i, c, make_source(c)) for i, c in enumerate(configs)]
        self.allowed_hosts = allowed_hosts
        self.guard = Guard(token)
        self.plans = bulk.Plans()
        self.interval = interval
        self.refresh = refresh
        self.started = time.time()

    async def sample_forever(self) -> None:
        while True:
            began = time.monotonic()
            await asyncio.gather(*(self.sample(queue) for queue in self.queues))
            await asyncio.sleep(max(0.1, self.interval - (time.monotonic() - began)))

    async def sample(self, queue: Queue) -> None:
        try:
            async with asyncio.timeout(max(self.interval * 2, 5)):
                counts = await queue.source.counts()
        except (BrokerError, TimeoutError, OSError) as error:
            queue.history.failed(f"{queue.name} at {queue.broker}: {error or 'no answer'}")
            return
        except Exception as error:  # one queue's broken state must not stop the others
            log.exception("sampling %s failed", queue.name)
            queue.history.failed(f"{queue.name}: {error!r}")
            return
        queue.history.add(counts)
        if isinstance(queue.source, RedisSource) and counts.consumers is not None:
            await self.sample_figures(queue, queue.source, counts.consumers)

    async def sample_figures(self, queue: Queue, source: RedisSource,
                             consumers: list[str]) -> None:
        """The supervisors' figures, for their rates on the queue page: a bonus, whose
        failure (the counts' own is told above) must never stop the sampler."""
        try:
            async with asyncio.timeout(max(self.interval, 5)):
                queue.rates.add(await source.figures(consumers))
        except Exception as error:  # any: the next sample tries again
            log.debug("the supervisors' figures of %s were not read: %r", queue.name, error)

    async def detail(self, queue: Queue) -> dict[str, Any]:
        """The queue page's broker reading: at most one per ``DETAIL_REUSE`` seconds and
        queue, whoever asks and however often (views meanwhile are given the last one).
        The supervisors are those the last sample found, if it is recent."""
        async with queue.detail_lock:
            if queue.last_detail and time.monotonic() - queue.last_detail[0] < DETAIL_REUSE:
                return queue.last_detail[1]
            last = queue.history.last
            recent = last is not None and time.time() - last.at < 3 * self.interval + 5
            consumers = last.counts.consumers if last is not None and recent else None
            if isinstance(queue.source, RedisSource):
                detail = await queue.source.detail(consumers)
                queue.rates.add(compare.readings(detail["supervisors"]))
                detail["figures"] = compare.rows(detail["supervisors"], queue.rates)
            else:
                detail = await queue.source.detail()
            queue.last_detail = (time.monotonic(), detail)
            return detail

    async def close(self) -> None:
        for queue in self.queues:
            await queue.source.close()


def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,  # every template, whatever its name
        undefined=jinja2.ChainableUndefined,  # a field a broker lacks shows as nothing
    )
    env.filters.update(show=show, ago=ago, utc=utc, number=number, seconds=seconds)
    env.tests.update(pid=pids.is_pid, dead_letter=pids.is_dead_letter)
    env.globals.update(  # the search's bounds, as the list page states them
        search_bound=search.SEARCH_ENTRIES, search_record_bytes=search.RECORD_BYTES,
        search_error_bytes=search.ERROR_BYTES, search_mib=search.SEARCH_BYTES >> 20)
    return env


def show(value: Any, limit: int = CELL) -> str:
    """Text from a broker, safe to read: unsafe characters visible, cut past ``limit``
    (newlines kept for tracebacks). The template's autoescape then escapes the HTML."""
    if value is None:
        return ""
    lines = str(value).split("\n")
    shown = "\n".join(logs.escape(line) for line in lines)
    if len(shown) > limit:
        return f"{shown[:limit]}... [cut: {len(str(value)):,} characters in all]"
    return shown


def ago(value: float | None) -> str:
    return "—" if value is None else seconds(max(0.0, time.time() - value)) + " ago"


def seconds(value: float | None) -> str:
    if value is None:
        return "—"
    if value < 120:
        return f"{value:.0f} s"
    if value < 7200:
        return f"{value / 60:.0f} min"
    if value < 172800:
        return f"{value / 3600:.1f} h"
    return f"{value / 86400:.1f} d"


def utc(value: float | None) -> str:
    if not value:
        return "—"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(value))


def number(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "—"
    return f"{value:,.{digits}f}"


def create_app(dashboard: Dashboard) -> Starlette:
    env = environment()

    def page(request: Request, name: str, status: int = 200, **values: Any) -> HTMLResponse:
        session_id = request.cookies.get(COOKIE)
        session = dashboard.guard.session(session_id)
        values.setdefault("once", Once(dashboard.guard, session_id))
        html = env.get_template(name).render(
            dashboard=dashboard, session=session, read_only=dashboard.guard.read_only,
            now=time.time(), request_path=request.url.path, **values)
        return HTMLResponse(html, status_code=status, headers=HEADERS)

    def guarded(handler: Callable[[Request], Awaitable[Response]]
                ) -> Callable[[Request], Awaitable[Response]]:
        """``handler``, for a session only when the dashboard has a token: a page is sent
        to the login (and back after it), a live fragment answers 401 (live.js stops)."""
        async def answer(request: Request) -> Response:
            if dashboard.guard.may_read(request.cookies.get(COOKIE)):
                return await handler(request)
            if request.url.path.startswith("/live/"):
                return Response("not logged in (or the session ended): log in again\n",
                                status_code=401, media_type="text/plain", headers=HEADERS)
            target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            return RedirectResponse(f"/login?next={quote(target, safe='')}", status_code=303,
                                    headers=HEADERS)
        return answer

    def queue_of(request: Request) -> Queue | None:
        index = request.path_params["index"]
        return dashboard.queues[index] if index < len(dashboard.queues) else None

    def not_found(request: Request, what: str) -> HTMLResponse:
        return page(request, "message.html", 404, title="Not found", message=what)

    def charts(queue: Queue, width: int, height: int, ticks: int) -> dict[str, plots.Chart]:
        end = time.time()
        first = queue.history.samples[0].at if queue.history.samples else None
        span = plots.span(first, end, queue.history.window)
        return {
            "ready": plots.chart(queue.history.series("ready"), end, span, width, height,
                                 ticks),
            "rate": plots.chart(queue.history.series("rate"), end, span, width, height,
                                ticks, unit="/s", whole=False),
        }

    async def overview(request: Request) -> Response:
        rows = [(queue, charts(queue, 150, 40, 3)) for queue in dashboard.queues]
        name = "overview_live.html" if request.url.path.startswith("/live") else "overview.html"
        return page(request, name, rows=rows)

    async def queue_page(request: Request) -> Response:
        queue = queue_of(request)
        if queue is None:
            return not_found(request, "no such queue")
        detail: dict[str, Any] = {}
        error = ""
        try:
            detail = await dashboard.detail(queue)
        except (BrokerError, OSError, nats.errors.Error) as failure:
            error = f"{queue.name} at {queue.broker}: {failure}"
        metrics = await scrape.read(queue.config)
        name = "queue_live.html" if request.url.path.startswith("/live") else "queue.html"
        return page(request, name, queue=queue, detail=detail, error=error, metrics=metrics,
                    charts=charts(queue, 600, 120, 5))

    async def listing(request: Request) -> Response:
        queue = queue_of(request)
        kind = request.path_params["kind"]
        if queue is None or kind not in LISTS:
            return not_found(request, "no such queue or list")
        query = search.Query.of(request.query_params)
        if query:
            return await searching(request, queue, kind, query)
        pid = request.query_params.get("pid", "").strip()
        page_number = _whole(request.query_params.get("page"))
        error, result = "", None
        on_nats = isinstance(queue.source, NatsSource)
        if pid and not (pids.is_dead_letter(pid) if on_nats else pids.is_pid(pid)):
            return page(request, "list.html", 400, queue=queue, kind=kind, listing=None,
                        error=pids.refusal(pid, on_nats), pid=pid, query=query)
        try:
            if isinstance(queue.source, NatsSource):
                result = await queue.source.listing(
                    kind, pid=pid, after=_whole(request.query_params.get("after")))
            else:
                result = await queue.source.listing(kind, page_number, pid)
        except (BrokerError, OSError, nats.errors.Error) as failure:
            error = f"{queue.name} at {queue.broker}: {failure}"
        return page(request, "list.html", queue=queue, kind=kind, listing=result, error=error,
                    pid=pid, query=query)

    async def find(queue: Queue, kind: str, query: search.Query) -> search.Found | None:
        """The search's matches (None: this queue has no such list to search)."""
        if isinstance(queue.source, NatsSource):
            if kind != "dead":
                return None
            stream = await queue.source.dead_stream()
            try:
                return await search.nats(stream, query)
            except (OSError, nats.errors.Error) as error:
                await queue.source.close()
                raise BrokerError(f"reading {stream.names.dead_stream}: {error!r}") from error
        return await queue.source.using(lambda broker: search.redis(broker, kind, query))

    async def searching(request: Request, queue: Queue, kind: str, query: search.Query
                        ) -> Response:
        error, found = "", None
        try:
            found = await find(queue, kind, query)
        except (BrokerError, OSError, nats.errors.Error) as failure:
            error = f"{queue.name} at {queue.broker}: {failure}"
        return page(request, "list.html", queue=queue, kind=kind, listing=None, found=found,
                    error=error, pid="", query=query)

    def bulk_kind(queue: Queue, kind: str) -> bool:
        """Whether a bulk action takes this list: failed or dead (NATS: the dead stream)."""
        return kind == "dead" or (kind == "failed" and not isinstance(queue.source, NatsSource))

    async def confirm_bulk(request: Request) -> Response:
        """The confirmation of a bulk action: the search again, its matches kept as the
        plan of the form shown (count, the first pids) under its one-time token."""
        queue = queue_of(request)
        kind = request.path_params["kind"]
        action = request.query_params.get("action", "")
        query = search.Query.of(request.query_params)
        if queue is None or kind not in LISTS:
            return not_found(request, "no such queue or list")
        back = f"/q/{queue.index}/list/{kind}" + (f"?{query.params()}" if query else "")
        session_id = request.cookies.get(COOKIE)
        session = dashboard.guard.session(session_id)
        if session is None or session_id is None:
            return page(request, "message.html", 403, title="Refused", queue=queue, back=back,
                        message="read-only: the dashboard was started without a token"
                        if dashboard.guard.read_only else "log in to act")
        if action not in bulk.ACTIONS or not bulk_kind(queue, kind) or not query:
            return page(request, "message.html", 400, title="Unknown action", queue=queue,
                        back=back, message=f"no bulk {action or 'action'} of {kind} here: "
                        "retry or delete what a search of failed or dead jobs matched")
        try:
            found = await find(queue, kind, query)
        except (BrokerError, OSError, nats.errors.Error) as failure:
            return page(request, "message.html", 503, title="Broker error", queue=queue,
                        back=back, message=f"{queue.name} at {queue.broker}: {failure}")
        if found is None or not found.selectors:
            return page(request, "message.html", title="Nothing to do", queue=queue,
                        back=back, message=f"nothing matches {query.describe()} now "
                        f"({found.note if found else 'no such list'}): nothing to {action}")
        once = Once(dashboard.guard, session_id)
        plan = dashboard.plans.put(once(), session_id, queue.index, kind, action,
                                   found.selectors)
        return page(request, "confirm.html", queue=queue, kind=kind, action=action,
                    selectors=plan.selectors, shown=plan.selectors[:bulk.SHOW],
                    digest=plan.digest, query=query, found=found, back=back, once=once,
                    target=f"/q/{queue.index}/bulk/{kind}", pid="")

    async def act_bulk(request: Request) -> Response:
        """Do the plan the form confirmed, exactly, once."""
        queue = queue_of(request)
        kind = request.path_params["kind"]
        form = await _form(request)
        action, once = form.get("action", ""), form.get("once", "")
        what = f"bulk {action} of {kind} ({form.get('count', '?')} confirmed)"
        session_id = request.cookies.get(COOKIE)
        session, refusal = dashboard.guard.check(session_id, form.get("csrf"), once)
        plan = None
        if session is not None and queue is not None:
            plan = dashboard.plans.take(once, session_id or "", queue.index, kind, action,
                                        form.get("digest", ""))
            if plan is None:
                session, refusal = None, ("this confirmation is not the one shown (another "
                                          "list, action or set of jobs) or was used "
                                          "already: nothing was done")
        if session is None or queue is None or plan is None:
            log.warning("dashboard action refused (%s) from %s: %s of queue %s", refusal,
                        _client(request), logs.escape(what), queue.name if queue else "?")
            if queue is None and session is not None:
                return not_found(request, "no such queue")
            return page(request, "message.html", 403, title="Refused", message=refusal,
                        **({"queue": queue} if queue else {}))
        try:
            if isinstance(queue.source, NatsSource):
                result = await bulk.nats(await queue.source.dead_stream(), queue.name,
                                         action, plan.selectors)
            else:
                broker = await queue.source.broker()
                result = await bulk.redis(broker, action, kind, plan.selectors)
        except (BrokerError, OSError, nats.errors.Error) as failure:
            result = f"{what} of {queue.name} failed: {failure} (some may have changed)"
        log.warning("dashboard action by %s from %s: %s", logs.escape(session.who),
                    _client(request), logs.escape(result))
        return page(request, "message.html", title="Done", message=result, queue=queue,
                    back=f"/q/{queue.index}/list/{kind}")

    async def confirm_one(request: Request) -> Response:
        """The confirmation of a single delete: the job named, and the form that deletes it."""
        queue = queue_of(request)
        if queue is None:
            return not_found(request, "no such queue")
        source, pid = request.query_params.get("source", ""), request.query_params.get(
            "pid", "")
        on_nats = isinstance(queue.source, NatsSource)
        back = f"/q/{queue.index}/list/{source}" if source in LISTS else f"/q/{queue.index}"
        if source == "poison" and not on_nats:
            return confirm_poison(request, queue, _whole(request.query_params.get("count")),
                                  back)
        if not (pids.is_dead_letter(pid) if on_nats else pids.is_pid(pid)):
            return page(request, "message.html", 400, title="Refused", queue=queue,
                        message=pids.refusal(pid, on_nats))
        if source not in (("dead",) if on_nats else actions.SOURCES):
            return page(request, "message.html", 400, title="Unknown action", queue=queue,
                        message=f"no delete from {source or 'that list'} here")
        if dashboard.guard.session(request.cookies.get(COOKIE)) is None:
            return page(request, "message.html", 403, title="Refused", queue=queue,
                        back=back, message="read-only: the dashboard was started without a "
                        "token" if dashboard.guard.read_only else "log in to act")
        return page(request, "confirm.html", queue=queue, kind=source, action="delete",
                    selectors=(pid,), shown=(pid,), back=back, pid=pid,
                    target=f"/q/{queue.index}/action", digest="", query=None, found=None)

    def confirm_poison(request: Request, queue: Queue, count: int, back: str) -> Response:
        """The confirmation of "delete the N oldest poison entries": N as the list page
        showed it (entries pushed since are newer, and LTRIM keeps the newest)."""
        if count < 1:
            return page(request, "message.html", 400, title="Unknown action", queue=queue,
                        back=back, message="say how many of the oldest poison entries to delete")
        if dashboard.guard.session(request.cookies.get(COOKIE)) is None:
            return page(request, "message.html", 403, title="Refused", queue=queue,
                        back=back, message="read-only: the dashboard was started without a "
                        "token" if dashboard.guard.read_only else "log in to act")
        return page(request, "confirm_poison.html", queue=queue, count=count, back=back,
                    target=f"/q/{queue.index}/action")

    async def job(request: Request) -> Response:
        queue = queue_of(request)
        if queue is None:
            return not_found(request, "no such queue")
        pid = request.query_params.get("pid", "")
        error, found = "", None
        on_nats = isinstance(queue.source, NatsSource)
        if not (pids.is_dead_letter(pid) if on_nats else pids.is_pid(pid)):
            return page(request, "job.html", 400, queue=queue, pid=pid, job=None,
                        error=pids.refusal(pid, on_nats))
        try:
            found = await queue.source.job(pid)
        except (BrokerError, OSError, nats.errors.Error) as failure:
            error = f"{queue.name} at {queue.broker}: {failure}"
        return page(request, "job.html", queue=queue, pid=pid, job=found, error=error)

    async def login_form(request: Request) -> Response:
        return page(request, "login.html", refused="",
                    target=local_target(request.query_params.get("next")))

    async def login(request: Request) -> Response:
        form = await _form(request)
        who = form.get("who", "").strip()
        target = local_target(form.get("next"))
        session_id = dashboard.guard.login(form.get("token", ""), who)
        if session_id is None:
            log.warning("dashboard login refused from %s", _client(request))
            refused = ("read-only: this dashboard was started without a token"
                       if dashboard.guard.read_only else "wrong token")
            return page(request, "login.html", 403, refused=refused, target=target)
        log.info("dashboard login of %s from %s", logs.escape(who), _client(request))
        answer = RedirectResponse(target, status_code=303, headers=HEADERS)
        answer.set_cookie(COOKIE, session_id, max_age=SESSION_SECONDS, httponly=True,
                          samesite="strict", secure=request.url.scheme == "https")
        return answer

    async def logout(request: Request) -> Response:
        form = await _form(request)
        if not dashboard.guard.logout(request.cookies.get(COOKIE), form.get("csrf")):
            return RedirectResponse("/", status_code=303, headers=HEADERS)
        answer = RedirectResponse("/login", status_code=303, headers=HEADERS)
        answer.delete_cookie(COOKIE)
        return answer

    async def act(request: Request) -> Response:
        queue = queue_of(request)
        form = await _form(request)
        action = form.get("action", "")
        what = (f"{action} {form.get('source', '')} {form.get('pid', '')}"
                f"{form.get('consumer', '')}{form.get('count', '')}").strip()
        session, refusal = dashboard.guard.check(request.cookies.get(COOKIE), form.get("csrf"),
                                                 form.get("once"))
        if session is None:
            log.warning("dashboard action refused (%s) from %s: %s of queue %s", refusal,
                        _client(request), logs.escape(what), queue.name if queue else "?")
            return page(request, "message.html", 403, title="Refused", message=refusal)
        if queue is None:
            return not_found(request, "no such queue")
        source, pid = form.get("source", ""), form.get("pid", "")
        on_nats = isinstance(queue.source, NatsSource)
        if pid and not (pids.is_dead_letter(pid) if on_nats else pids.is_pid(pid)):
            return page(request, "message.html", 400, title="Refused",
                        message=pids.refusal(pid, on_nats), queue=queue)
        try:
            if isinstance(queue.source, NatsSource):
                if action not in ("retry", "delete") or source != "dead" or not pid:
                    return page(request, "message.html", 400, title="Unknown action",
                                message=f"unknown action or missing field: {what} (a "
                                "JetStream queue takes retry and delete of a dead letter)")
                result = await actions.nats_dead_letter(
                    await queue.source.dead_stream(), queue.name, action, pid,
                    NATS_SEARCH_DEPTH)
            else:
                broker = await queue.source.broker()
                if action in ("retry", "delete") and source in actions.SOURCES and pid:
                    job_action = actions.retry_job if action == "retry" else actions.delete_job
                    result = await job_action(broker, source, pid)
                elif action == "delete" and source == "poison" and _whole(form.get("count")):
                    result = await actions.delete_poison(broker, _whole(form.get("count")))
                elif action == "drain" and form.get("consumer"):
                    result = await actions.drain_supervisor(broker, form["consumer"])
                else:
                    return page(request, "message.html", 400, title="Unknown action",
                                message=f"unknown action or missing field: {what}")
        except (BrokerError, OSError, nats.errors.Error) as failure:
            result = f"{what} of {queue.name} failed: {failure} (nothing may have changed)"
        log.warning("dashboard action by %s from %s: %s", logs.escape(session.who),
                    _client(request), logs.escape(result))
        return page(request, "message.html", title="Done", message=result, queue=queue)

    async def healthz(request: Request) -> Response:
        return Response("ok\n", media_type="text/plain")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        sampler = asyncio.create_task(dashboard.sample_forever())
        try:
            yield
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
            await dashboard.close()

    routes = [
        Route("/", guarded(overview)),
        Route("/live/overview", guarded(overview)),
        Route("/q/{index:int}", guarded(queue_page)),
        Route("/live/q/{index:int}", guarded(queue_page)),
        Route("/q/{index:int}/list/{kind}", guarded(listing)),
        Route("/q/{index:int}/job", guarded(job)),
        Route("/q/{index:int}/action", act, methods=["POST"]),
        Route("/q/{index:int}/confirm", guarded(confirm_one)),
        Route("/q/{index:int}/bulk/{kind}", guarded(confirm_bulk)),
        Route("/q/{index:int}/bulk/{kind}", act_bulk, methods=["POST"]),
        Route("/login", login_form),
        Route("/login", login, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]),
        Route("/healthz", healthz),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    middleware = []
    if dashboard.allowed_hosts:
        # A page of another site that rebinds its own name to 127.0.0.1 (DNS rebinding)
        # reaches a loopback dashboard under that name: answered 400, not with the queues.
        middleware.append(Middleware(TrustedHostMiddleware,
                                     allowed_hosts=dashboard.allowed_hosts, www_redirect=False))
    return Starlette(routes=routes, lifespan=lifespan, middleware=middleware)


async def _form(request: Request) -> dict[str, str]:
    """An urlencoded form's fields (the first value of each), at most MAX_FORM bytes."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM:
            return {}
    fields = parse_qs(body.decode(errors="replace"), max_num_fields=20)
    return {name: values[0] for name, values in fields.items()}


class Once:
    """A page's one-time action token, minted on first use by its forms (``auth.issue``):
    a page without an action form mints none."""

    def __init__(self, guard: Guard, session_id: str | None) -> None:
        self._guard, self._session_id = guard, session_id
        self._value: str | None = None

    def __call__(self) -> str:
        if self._value is None:
            self._value = self._guard.issue(self._session_id)
        return self._value


def _whole(text: str | None) -> int:
    return int(text) if text and text.isdecimal() and len(text) < 10 else 0


def _client(request: Request) -> str:
    client = request.client
    agent = request.headers.get("user-agent", "")[:80]
    return f"{client.host if client else '?'} ({logs.escape(agent)})"
