"""When registering a name a second time is the same registration, not a conflict.

Every registry (environments, policy losses, advantage estimators, sampler backends) is
filled by `register...` calls in modules a recipe imports, and a recipe file runs again each
time a config is read from it (the override check reads it twice; a recipe built on another
reads that one too). Running again builds new function objects from the same source, so
identity alone would call that a conflict. `same_registration(old, new)` is true when the
two registrations are equal field by field, callables compared by where they are defined:

    same callable       old is new, or the same definition: equal qualified name, module,
                        file and first line (unwrapping functools.wraps / jax.jit; for a
                        class, its first method written in the class body)
    functools.partial   the same definition of `func` with equal args and keywords
    anything else       ==

A registry makes that second call a no-op; another definition under a registered name is
still an error unless the caller asks to replace it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any


def same_registration(old: Any, new: Any) -> bool:
    """Whether registering `new` where `old` is registered changes nothing (module doc)."""
    if old is new:
        return True
    if dataclasses.is_dataclass(old) and not isinstance(old, type) and type(old) is type(new):
        return all(same_registration(getattr(old, f.name), getattr(new, f.name))
                   for f in dataclasses.fields(old))
    if callable(old) and callable(new):
        a, b = _definition(old), _definition(new)
        return a is not None and _equal(a, b)
    return _equal(old, new)


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # e.g. arrays, whose == is elementwise: not provably the same
        return False


def _definition(obj: Any) -> tuple | None:
    """Where `obj` is defined, or None when that says nothing (then only `is` is the same)."""
    if isinstance(obj, functools.partial):
        inner = _definition(obj.func)
        return None if inner is None else (inner, obj.args, tuple(sorted(obj.keywords.items())))
    obj = inspect.unwrap(obj)
    if isinstance(obj, type):
        code = next((c for c in map(_code, vars(obj).values())
                     if c is not None and not c.co_filename.startswith("<")), None)
    else:
        code = _code(obj)
    if code is None:
        return None
    return (getattr(obj, "__module__", None), getattr(obj, "__qualname__", None),
            code.co_filename, code.co_firstlineno)


def _code(obj: Any):
    """The code object of a function (or of a staticmethod's / classmethod's), else None."""
    return getattr(getattr(obj, "__func__", obj), "__code__", None)
