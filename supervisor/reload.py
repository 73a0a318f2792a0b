"""SIGHUP: the handler code imported afresh (gunicorn's HUP without ``preload_app``).

The fork server imports the handler anew in a new handler server (``Spawner.reload``;
worker.forkserver says why there and how). Only once that import succeeded, and the new code
has the shape this job was set up for (``Shape.change_problem``), does the handler pool
(supervisor.pool) replace the handler processes, each after its current work, as at
recycling. Until then, and for good if the import failed or the shape changed, the running
processes keep consuming with the code they have, and one error line says why. One import
runs at a time: a SIGHUP during one asks for another once it is done (the files may have
changed after it read them). What the new code does once running is judged as at start: an
init() that cannot heal halts (exit 3).
"""

from __future__ import annotations

import logging

from worker.forkserver import Event, Spawner
from worker.handler import Shape

log = logging.getLogger("supervisor")

#: The fork server's events about the handler code (the rest are about processes).
CODE_EVENTS = frozenset(("loaded", "load_failed", "retired"))


class HandlerCode:
    """The code the handler processes run, and the reload under way (if any)."""

    def __init__(self, spawner: Spawner, running: Shape) -> None:
        self.spawner = spawner
        self.running = running
        #: The generation its processes come from (None: the first, whatever its number).
        self.generation: int | None = None
        self.loading: int | None = None  # the generation importing now
        self.again = False  # a SIGHUP came during that import

    def reload(self) -> None:
        """SIGHUP (not while stopping): import the handler anew, or again after the import
        under way."""
        if self.loading is not None:
            self.again = True
            log.info("SIGHUP received: a reload is under way; another follows it")
            return
        self.loading = self.spawner.reload()
        log.info("SIGHUP received: reloading: importing %s anew", self.running.spec)

    def outdated(self, generation: int) -> bool:
        """A process of ``generation`` runs code a reload replaced (it was asked for before
        the reload's import succeeded and started after): it is to be replaced too."""
        return self.generation is not None and generation != self.generation

    def finished(self, event: Event, replacing: int, stopping: bool) -> bool:
        """A "loaded", "load_failed" or "retired" event. True: the new code is adopted, and
        the ``replacing`` processes running the old are to be replaced."""
        if event.kind == "retired":
            log.info("handler server %d (code generation %d) exited: its processes were all "
                     "replaced", event.pid, event.generation)
            return False
        if event.generation != self.loading:  # not asked for (a bug): it must not linger
            if event.kind == "loaded":
                self.spawner.discard(event.generation)
            return False
        self.loading = None
        adopted = False
        if stopping:
            if event.kind == "loaded":
                self.spawner.discard(event.generation)
            log.info("the reload's import ended during the stop: not used")
        else:
            adopted = self.settle(event, replacing)
        if self.again and not stopping:
            self.again = False
            self.loading = self.spawner.reload()
            log.info("reloading again (a SIGHUP came during the last import): importing %s "
                     "anew", self.running.spec)
        return adopted

    def settle(self, event: Event, replacing: int) -> bool:
        """Adopt the loaded code, or say why the running processes keep theirs."""
        kept = f"the handler processes keep running the code loaded before: {self.source()}"
        if event.kind == "load_failed":
            log.error("handler reload failed: %s; %s", event.detail, kept)
            return False
        try:
            loaded = Shape.decode(event.detail)
        except (ValueError, KeyError, TypeError) as error:  # a bug: the report is ours
            problem: str | None = f"the handler server's report is unreadable ({error!r})"
        else:
            problem = self.running.change_problem(loaded)
        if problem:
            self.spawner.discard(event.generation)
            log.error("handler reload refused: %s; %s", problem, kept)
            return False
        self.spawner.adopt(event.generation)
        self.running, self.generation = loaded, event.generation
        log.info("handler reloaded: %s; replacing %d handler processes, each after its "
                 "current work", self.source(), replacing)
        return True

    def source(self) -> str:
        return f"{self.running.spec} from {self.running.source()}"
