"""Finding the handler function and its optional module hooks by dotted path."""

from __future__ import annotations

import importlib
import inspect
import re
import sys
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

    Loaded once, by the configuration check in the supervisor (before the fork server
    starts): the arbiter reads it, and every handler process inherits it through fork.
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
    return target


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
            f'(README: "Where handler code lives")')


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
