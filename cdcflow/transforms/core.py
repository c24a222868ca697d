"""Map, FlatMap and Filter: ParDos around a plain function.

Each wraps ``fn`` (any callable; lambdas and closures are fine, tasks are pickled with
cloudpickle) in a :class:`~cdcflow.transforms.base.DoFn`. Extra positional and keyword
arguments are passed to ``fn`` after the element: ``Map(fn, 1, k=2)`` calls ``fn(x, 1, k=2)``.

Default labels are stable and readable, because labels key stored state:
``Map(to_row)`` for a named function, ``Filter(<lambda> at pipeline.py:12)`` for a lambda.

Typing: ``pcoll | Map(f)`` with ``pcoll: PCollection[A]`` and ``f: Callable[[A, ...], B]``
is a ``PCollection[B]`` (FlatMap: ``f`` returns ``Iterable[B]``; Filter keeps ``A``), and
the extra arguments are checked against ``f``'s. A lambda's parameter takes its type from
the PCollection it is applied to; behind a label (``"x" >> Map(lambda r: ...)``) a type
checker sees no PCollection, so the lambda's parameter and the output are ``Any``.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, cast

from cdcflow.errors import PipelineDefinitionError
from cdcflow.transforms.base import DoFn, ParDo

__all__ = ["Filter", "FlatMap", "Map", "callable_name"]

_MAX_REPR = 40

InT = TypeVar("InT")
OutT = TypeVar("OutT")
R = TypeVar("R")
P = ParamSpec("P")


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


def function_kind(fn: Callable[..., object]) -> str | None:
    """What kind of function ``fn`` is when calling it does not run its body: "an async
    function" (``async def``, also an async generator) or "a generator function"; None for
    a plain function. A callable object is judged by its ``__call__``."""
    for f in (fn, type(fn).__call__):
        if inspect.iscoroutinefunction(f) or inspect.isasyncgenfunction(f):
            return "an async function"
        if inspect.isgeneratorfunction(f):
            return "a generator function"
    return None


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
    kind = function_kind(fn)
    if kind == "an async function" or (kind is not None and transform != "FlatMap"):
        fix = ("use FlatMap for a function that yields its outputs" if kind ==
               "a generator function" else "tasks call functions on threads: pass a plain "
               "function, e.g. lambda r: asyncio.run(convert(r))")
        msg = (f"{transform}({callable_name(fn)}): the function is {kind}, so calling it "
               f"would not run its body; {fix}")
        raise PipelineDefinitionError(msg)


class _CallableDoFn(DoFn[InT, OutT], Generic[InT, OutT, R]):
    """A DoFn calling ``fn(element, *args, **kwargs) -> R``; subclasses decide what to emit."""

    def __init__(self, fn: Callable[..., R], args: tuple[Any, ...], kwargs: dict[str, Any]):
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        # Named once, where the pipeline is built: a lambda shipped by value to a worker
        # may come back with another code file name, and labels key stored state.
        self.fn_name = callable_name(fn)

    def _call(self, element: InT) -> R:
        return self.fn(element, *self.args, **self.kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.fn_name})"


class _MapFn(_CallableDoFn[InT, OutT, OutT]):
    def process(self, element: InT) -> Iterable[OutT]:
        return (self.fn(element, *self.args, **self.kwargs),)  # _call, inline: per element

    def as_function(self) -> Callable[[InT], OutT]:
        return self.fn if not self.args and not self.kwargs else self._call


class _FlatMapFn(_CallableDoFn[InT, OutT, Iterable[OutT]]):
    def process(self, element: InT) -> Iterable[OutT]:
        out: object = self._call(element)
        # A str, bytes or dict is iterable, but returning one is nearly always a Map by mistake.
        if isinstance(out, str | bytes | Mapping) or not isinstance(out, Iterable):
            msg = (
                f"FlatMap({self.fn_name}) returned a value of type {type(out).__name__}; it must "
                "return an iterable of outputs (a list, tuple or generator): use Map for "
                "exactly one output per element"
            )
            raise TypeError(msg)
        return cast("Iterable[OutT]", out)


class _FilterFn(_CallableDoFn[InT, InT, object]):
    def process(self, element: InT) -> Iterable[InT]:
        return (element,) if self._call(element) else ()


class _CallableParDo(ParDo[InT, OutT]):
    """A ParDo built from a plain function; the label is ``Kind(function name)``."""

    fn: _CallableDoFn[InT, OutT, Any]

    def __init__(self, fn: _CallableDoFn[InT, OutT, Any]) -> None:
        super().__init__(fn)

    def default_label(self) -> str:
        return f"{type(self).__name__}({self.fn.fn_name})"

    def describe_params(self) -> str:
        parts = [f"fn={self.fn.fn_name}"]
        parts += [_short_repr(a) for a in self.fn.args]
        parts += [f"{k}={_short_repr(v)}" for k, v in self.fn.kwargs.items()]
        return " ".join(parts)


class Map(_CallableParDo[InT, OutT]):
    """Emit ``fn(element, *args, **kwargs)`` for every element: one output per input.

    ``Map(f)`` with ``f: Callable[[A], B]`` is a ``PTransform[A, B]``.
    """

    def __init__(
        self, fn: Callable[Concatenate[InT, P], OutT], *args: P.args, **kwargs: P.kwargs
    ) -> None:
        _check_callable(type(self).__name__, fn)
        super().__init__(_MapFn(fn, args, kwargs))


class FlatMap(_CallableParDo[InT, OutT]):
    """Emit every item of the iterable ``fn(element, *args, **kwargs)`` returns (zero or more).

    ``FlatMap(f)`` with ``f: Callable[[A], Iterable[B]]`` is a ``PTransform[A, B]``.
    Returning a str, bytes or dict raises TypeError (use Map for a single output).
    """

    def __init__(
        self,
        fn: Callable[Concatenate[InT, P], Iterable[OutT]],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> None:
        _check_callable(type(self).__name__, fn)
        super().__init__(_FlatMapFn(fn, args, kwargs))


class Filter(_CallableParDo[InT, InT]):
    """Keep the elements for which ``fn(element, *args, **kwargs)`` is truthy.

    ``Filter(f)`` with ``f: Callable[[A], object]`` is a ``PTransform[A, A]``.
    """

    def __init__(
        self, fn: Callable[Concatenate[InT, P], object], *args: P.args, **kwargs: P.kwargs
    ) -> None:
        _check_callable(type(self).__name__, fn)
        super().__init__(_FilterFn(fn, args, kwargs))
