"""Finding the handler function and its optional module hooks by dotted path."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any


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
    return Handler(
        module, call, _hook(module, "init"), _hook(module, "flush"),
        _hook(module, "on_success"), _hook(module, "on_error"),
    )


def _hook(module: ModuleType, name: str) -> Any:
    hook = getattr(module, name, None)
    return hook if callable(hook) else None
