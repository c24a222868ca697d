"""Map, FlatMap and Filter: ParDos around a plain function.

Each wraps ``fn`` (any callable; lambdas and closures are fine, tasks are pickled with
cloudpickle) in a :class:`~cdcflow.transforms.base.DoFn`. Extra positional and keyword
arguments are passed to ``fn`` after the element: ``Map(fn, 1, k=2)`` calls ``fn(x, 1, k=2)``.

Default labels are stable and readable, because labels key stored state:
``Map(to_row)`` for a named function, ``Filter(<lambda> at pipeline.py:12)`` for a lambda.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from cdcflow.transforms.base import DoFn, ParDo

__all__ = ["Filter", "FlatMap", "Map", "callable_name"]

_MAX_REPR = 40


def callable_name(fn: Callable[..., Any]) -> str:
    """A stable, readable name of ``fn`` for labels and ``cdcflow graph``.

    Named functions give their name (``to_row``; ``Cls.method`` for methods), lambdas
    give ``<lambda> at FILE:LINE`` (file basename), partials and callable objects give
    the name of what they wrap or of their class.
    """
    if isinstance(fn, functools.partial):
        return f"partial({callable_name(fn.func)})"
    name = getattr(fn, "__name__", None)
    if not isinstance(name, str):
        return type(fn).__name__  # a callable object
    if name == "<lambda>":
        code = getattr(fn, "__code__", None)
        if code is not None:
            return f"<lambda> at {os.path.basename(code.co_filename)}:{code.co_firstlineno}"
        return name
    qualname = getattr(fn, "__qualname__", name)
    # "outer.<locals>.to_row" is noise in a label; "Cls.method" is not.
    return qualname if isinstance(qualname, str) and "<" not in qualname else name


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_REPR else text[: _MAX_REPR - 3] + "..."


def _check_callable(transform: str, fn: Any) -> None:
    if isinstance(fn, DoFn) and not callable(fn):
        msg = f"{transform} takes a function, got the DoFn {fn!r}: use ParDo({fn!r}) instead"
        raise TypeError(msg)
    if not callable(fn):
        msg = (
            f"{transform} takes a function, got {_short_repr(fn)} ({type(fn).__name__}): "
            f"pass the function itself, e.g. {transform}(to_row) or {transform}(lambda r: ...)"
        )
        raise TypeError(msg)


class _CallableDoFn(DoFn):
    """A DoFn calling ``fn(element, *args, **kwargs)``; subclasses decide what to emit."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]):
        self.fn = fn
        self.args = args
        self.kwargs = kwargs

    def __repr__(self) -> str:
        return f"{type(self).__name__}({callable_name(self.fn)})"


class _MapFn(_CallableDoFn):
    def process(self, element: Any) -> Iterable[Any]:
        return (self.fn(element, *self.args, **self.kwargs),)


class _FlatMapFn(_CallableDoFn):
    def process(self, element: Any) -> Iterable[Any]:
        out = self.fn(element, *self.args, **self.kwargs)
        # A str, bytes or dict is iterable, but returning one is nearly always a Map by mistake.
        if isinstance(out, str | bytes | Mapping) or not isinstance(out, Iterable):
            msg = (
                f"FlatMap({callable_name(self.fn)}) returned a {type(out).__name__}; it must "
                "return an iterable of outputs (a list, tuple or generator): use Map for "
                "exactly one output per element"
            )
            raise TypeError(msg)
        return out


class _FilterFn(_CallableDoFn):
    def process(self, element: Any) -> Iterable[Any]:
        return (element,) if self.fn(element, *self.args, **self.kwargs) else ()


class _CallableParDo(ParDo):
    """A ParDo built from a plain function; the label is ``Kind(function name)``."""

    _dofn: type[_CallableDoFn] = _CallableDoFn
    fn: _CallableDoFn

    def __init__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        _check_callable(type(self).__name__, fn)
        super().__init__(self._dofn(fn, args, kwargs))

    def default_label(self) -> str:
        return f"{type(self).__name__}({callable_name(self.fn.fn)})"

    def describe_params(self) -> str:
        parts = [f"fn={callable_name(self.fn.fn)}"]
        parts += [_short_repr(a) for a in self.fn.args]
        parts += [f"{k}={_short_repr(v)}" for k, v in self.fn.kwargs.items()]
        return " ".join(parts)


class Map(_CallableParDo):
    """Emit ``fn(element, *args, **kwargs)`` for every element: one output per input."""

    _dofn = _MapFn


class FlatMap(_CallableParDo):
    """Emit every item of the iterable ``fn(element, *args, **kwargs)`` returns (zero or more).

    Returning a str, bytes or dict raises TypeError (use Map for a single output).
    """

    _dofn = _FlatMapFn


class Filter(_CallableParDo):
    """Keep the elements for which ``fn(element, *args, **kwargs)`` is truthy."""

    _dofn = _FilterFn
