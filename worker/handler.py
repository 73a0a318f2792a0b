"""Finding the handler function and its optional module hooks by dotted path, and what the
supervisor knows of it (``Shape``: it never imports the handler itself)."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from broker.errors import describe

#: The module-level hooks a handler module may define besides the handler function.
HOOKS = ("init", "flush", "on_success", "on_error")


class HandlerError(ValueError):
    """The handler path is malformed, its module does not import, or it is not callable."""


@dataclass(slots=True, frozen=True)
class Handler:
    """The handler function and the module-level hooks its module defines (or None).

    Loaded in each handler server (``worker.forkserver``), at start and at every reload:
    its handler processes inherit it through fork; the supervisor learns its ``shape``.
    """

    spec: str  # the path it was loaded from, as configured (for log lines)
    module: ModuleType
    call: Callable[[Any], object]
    init: Callable[[], object] | None
    flush: Callable[[], object] | None
    on_success: Callable[[Any], object] | None
    on_error: Callable[[Any, BaseException], object] | None
    #: ``async def handle``: the process runs an event loop with several deliveries at once.
    is_async: bool = False

    @property
    def wants_confirm(self) -> bool:
        """The supervisor tells the process how each success settled (for ``on_success``)."""
        return self.on_success is not None

    @property
    def flushes(self) -> bool:
        """The module defines ``flush()``: dispatch fills one process before the next."""
        return self.flush is not None

    @property
    def shape(self) -> Shape:
        hooks = tuple(name for name in HOOKS if getattr(self, name) is not None)
        file = getattr(self.module, "__file__", None)
        modified = None
        if file:
            # Gone or unreadable since the import: the log line says less.
            with contextlib.suppress(OSError):
                modified = os.stat(file).st_mtime
        top = sys.modules.get(self.module.__name__.partition(".")[0])
        version = getattr(self.module, "__version__", None) or getattr(top, "__version__", None)
        return Shape(self.spec, self.is_async, hooks, file, modified,
                     None if version is None else str(version))


#: The longest text of each field a Shape carries to the supervisor, cut in the middle beyond:
#: its report must fit one atomic pipe write (worker.forkserver.DETAIL_LIMIT, 4,077 bytes),
#: and JSON writes a character as up to 6 bytes (``\udc80``).
SHAPE_FIELD_LIMIT = 200


@dataclass(slots=True, frozen=True)
class Shape:
    """What the supervisor knows of the handler loaded in a handler server: its kind and
    hooks, which the supervisor's dispatch and settlement were set up for, and where its code
    came from (for the log line of a start or a reload)."""

    spec: str
    is_async: bool
    hooks: tuple[str, ...]
    file: str | None = None
    modified: float | None = None  # the file's modification time (seconds since the epoch)
    version: str | None = None  # the module's __version__ (or its top package's)

    @property
    def wants_confirm(self) -> bool:
        return "on_success" in self.hooks

    @property
    def flushes(self) -> bool:
        return "flush" in self.hooks

    @property
    def kind(self) -> str:
        return "async def" if self.is_async else "plain def"

    def encode(self) -> str:
        fields = {"spec": self.spec, "is_async": self.is_async, "hooks": self.hooks,
                  "file": self.file, "modified": self.modified, "version": self.version}
        return json.dumps({name: _cut(value) for name, value in fields.items()})

    @classmethod
    def decode(cls, text: str) -> Shape:
        fields = json.loads(text)
        return cls(fields["spec"], bool(fields["is_async"]), tuple(fields["hooks"]),
                   fields["file"], fields["modified"], fields["version"])

    def source(self) -> str:
        """Where the code came from: ``/srv/jobs/usage.py (modified 2025-06-01 10:00:03 UTC,
        version 2.1)``."""
        about = []
        if self.modified is not None:
            about.append("modified " + time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                     time.gmtime(self.modified)))
        if self.version is not None:
            about.append(f"version {self.version}")
        where = self.file or f"module {split(self.spec)[0]} (no file)"
        return f"{where} ({', '.join(about)})" if about else where

    def change_problem(self, new: Shape) -> str | None:
        """Why handler processes running ``new`` cannot replace those running this code: the
        supervisor set up its dispatch and settlement at start for this kind of handler and
        these hooks. init() and on_error() may come and go (their process alone uses them)."""
        changes = []
        if new.is_async != self.is_async:
            changes.append(f"is now an {new.kind} (it was a {self.kind})")
        for hook in ("on_success", "flush"):
            if hook in new.hooks and hook not in self.hooks:
                changes.append(f"now defines {hook}(), which this job was started without")
            elif hook in self.hooks and hook not in new.hooks:
                changes.append(f"no longer defines {hook}(), which this job was started with")
        if not changes:
            return None
        return (f'handler "{new.spec}" {"; ".join(changes)}: the supervisor set up its dispatch '
                "and settlement for the handler it started with, so such a change needs a "
                "restart of the service")


def _cut(value: Any) -> Any:
    if isinstance(value, str) and len(value) > SHAPE_FIELD_LIMIT:
        half = SHAPE_FIELD_LIMIT // 2
        return f"{value[:half]}...{value[-half:]}"
    return value


def is_async(function: object) -> bool:
    """An ``async def`` (or a callable object whose ``__call__`` is one, or a partial of one)."""
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(
        getattr(function, "__call__", None)  # noqa: B004 - the method itself is inspected
    )


def async_hooks_problem(call: object, module: ModuleType) -> str | None:
    """Why the module cannot run: async hooks beside a plain ``def`` handler. A sync
    process would call them and drop the coroutine unawaited: a flush() that never ran,
    with its messages acknowledged."""
    if is_async(call):
        return None
    found = [name for name in HOOKS if is_async(getattr(module, name, None))]
    if not found:
        return None
    return (f"{module.__name__} defines async {', '.join(f'{n}()' for n in found)} but its "
            "handler is a plain def: async hooks need an async def handler")


_DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"


def split(spec: str) -> tuple[str, str]:
    """``"pkg.mod:func"`` or ``"pkg.mod.func"`` -> ``("pkg.mod", "func")``; after a colon
    the attribute may be dotted (``"pkg.mod:Class.method"``)."""
    module, colon, attribute = spec.partition(":")
    if not colon:
        module, _, attribute = spec.rpartition(".")
    if not (re.fullmatch(_DOTTED, module) and re.fullmatch(_DOTTED, attribute)):
        raise HandlerError(
            f'handler "{spec}" is not of the form "pkg.module:function" or "pkg.module.function"'
        )
    return module, attribute


def resolve(spec: str) -> Callable[..., Any]:
    """Import the module a handler spec names and return its callable (``load``'s first
    step); raises HandlerError."""
    module_name, attribute = split(spec)
    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise HandlerError(f'handler "{spec}" cannot be imported: {_one_line(error)}; '
                           f"{not_found_hint(module_name, error.name)}") from error
    except (Exception, SystemExit) as error:  # the module's own code may raise anything
        raise HandlerError(f'handler "{spec}" cannot be imported: {_one_line(error)}') from error
    for name in attribute.split("."):
        try:
            target = getattr(target, name)
        except AttributeError:
            raise HandlerError(
                f'handler "{spec}": module {module_name} has no attribute {attribute}'
            ) from None
    if not callable(target):
        raise HandlerError(f'handler "{spec}" is a {type(target).__name__}, not a callable')
    handler: Callable[..., Any] = target
    return handler


def not_found_hint(module_name: str, missing: str | None) -> str:
    """What to do about a module that is not found: the handler's own (its code is not where
    this interpreter looks) or one it imports (a dependency not installed beside it)."""
    parts = module_name.split(".")
    if missing not in {".".join(parts[:end]) for end in range(1, len(parts) + 1)}:
        return (f"{module_name} imports {missing}, which this Python ({sys.executable}) does "
                f"not have: install it into the same environment")
    top = parts[0]
    return (f"{top} is neither installed in this Python's environment nor on PYTHONPATH: "
            f"install the package holding it there ({sys.executable} -m pip install "
            f"/path/to/your/project), or set PYTHONPATH to the folder that contains {top}/ "
            f'(docs/handlers.md: "Where handler code lives")')


def load(spec: str) -> Handler:
    """The handler ``spec`` names, with its module's hooks; raises HandlerError."""
    call = resolve(spec)
    module = importlib.import_module(split(spec)[0])
    problem = async_hooks_problem(call, module)
    if problem:
        raise HandlerError(f'handler "{spec}": {problem}')
    return Handler(
        spec, module, call, _hook(module, "init"), _hook(module, "flush"),
        _hook(module, "on_success"), _hook(module, "on_error"), is_async(call),
    )


def _one_line(error: BaseException) -> str:
    return " ".join(describe(error).split())  # the error is one line


def _hook(module: ModuleType, name: str) -> Any:
    hook = getattr(module, name, None)
    return hook if callable(hook) else None
