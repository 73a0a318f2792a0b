"""Finding the handler function and its optional module hooks by dotted path."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

#: The module-level hooks a handler module may define besides the handler function.
HOOKS = ("init", "flush", "on_success", "on_error")


class HandlerError(ValueError):
    """The handler path is malformed, its module does not import, or it is not callable."""


@dataclass(slots=True, frozen=True)
class Handler:
    """The handler function and the module-level hooks its module defines (or None)."""

    module: ModuleType
    call: Callable[[Any], object]
    init: Callable[[], object] | None
    flush: Callable[[], object] | None
    on_success: Callable[[Any], object] | None
    on_error: Callable[[Any, BaseException], object] | None
    #: ``async def handle``: the process runs an event loop with several deliveries at once.
    is_async: bool = False


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


def load(spec: str) -> Handler:
    """Resolve ``"pkg.mod:func"`` or ``"pkg.mod.func"``; raises HandlerError."""
    module_name, _, function_name = spec.rpartition(":" if ":" in spec else ".")
    if not module_name or not function_name:
        raise HandlerError(f"handler {spec!r} is not 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        raise HandlerError(
            f"handler module {module_name!r} failed to import: {type(error).__name__}: {error}"
        ) from error
    call = getattr(module, function_name, None)
    if not callable(call):
        raise HandlerError(f"{module_name}.{function_name} is not a callable")
    problem = async_hooks_problem(call, module)
    if problem:
        raise HandlerError(problem)
    return Handler(
        module, call, _hook(module, "init"), _hook(module, "flush"),
        _hook(module, "on_success"), _hook(module, "on_error"), is_async(call),
    )


def _hook(module: ModuleType, name: str) -> Any:
    hook = getattr(module, name, None)
    return hook if callable(hook) else None
