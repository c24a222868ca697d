"""Load a Pipeline from a Python file (what ``cdcflow run FILE`` does).

A pipeline file defines a module-level :class:`~cdcflow.pipeline.Pipeline`, or a
function that returns one (annotated ``-> Pipeline``, or named ``pipeline``,
``build_pipeline``, ``make_pipeline`` or ``create_pipeline``). When a file holds several,
``FILE:NAME`` picks one; ``NAME`` may also name any function taking no arguments.

The file runs as a module of its own (not ``__main__``, so an ``if __name__ ==
"__main__":`` block does not run), with its directory first on ``sys.path`` so it can
import modules next to it. Its functions and classes are registered with cloudpickle to
travel by value, because Spark's Python workers cannot import a file by path.

Contract: every failure is a :class:`~cdcflow.errors.PipelineFileError` whose one-line
message names the cause and the fix, except errors that are already
:class:`~cdcflow.errors.UserInputError` (such as a duplicate label), which pass through.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import re
import sys
import traceback
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle

from cdcflow.errors import PipelineFileError, UserInputError
from cdcflow.pipeline import Pipeline

__all__ = ["PIPELINE_FUNCTION_NAMES", "load_module", "load_pipeline", "split_target"]

#: Unannotated zero-argument functions with these names count as pipeline factories.
PIPELINE_FUNCTION_NAMES = ("pipeline", "build_pipeline", "make_pipeline", "create_pipeline")

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def split_target(target: str | Path) -> tuple[Path, str | None]:
    """Split ``"FILE"`` or ``"FILE:NAME"`` into the path and the optional attribute name."""
    text = str(target)
    head, sep, tail = text.rpartition(":")
    if sep and head and _IDENT.match(tail) and not Path(text).exists():
        return Path(head), tail
    return Path(text), None


def load_pipeline(target: str | Path) -> Pipeline:
    """The Pipeline defined by the file ``target`` (``"FILE"`` or ``"FILE:NAME"``).

    Raises PipelineFileError (missing file, syntax error with file:line, import error,
    no Pipeline, several Pipelines without ``:NAME``); UserInputErrors raised while the
    file builds its pipeline (e.g. DuplicateLabelError) pass through unchanged.
    """
    path, name = split_target(target)
    module = load_module(path)
    if name is not None:
        return _pick_named(module, path, name)
    return _pick_default(module, path)


def load_module(path: str | Path) -> types.ModuleType:
    """Execute the Python file at ``path`` as a fresh module and return it."""
    path = Path(path)
    if not path.exists():
        msg = (
            f"pipeline file {str(path)!r} not found; check the path (relative paths start "
            f"at {Path.cwd()})"
        )
        raise PipelineFileError(msg)
    if not path.is_file():
        msg = f"{str(path)!r} is a directory; give the pipeline's .py file, e.g. {path}/pipeline.py"
        raise PipelineFileError(msg)
    path = path.resolve()
    module_name = _module_name(path)
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        msg = f"cannot load {str(path)!r} as Python; give a .py file"
        raise PipelineFileError(msg)
    module = importlib.util.module_from_spec(spec)
    # Registered before running it: dataclasses, attrs and pickling look modules up by name.
    sys.modules[module_name] = module
    directory = str(path.parent)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    try:
        spec.loader.exec_module(module)
    except UserInputError:
        sys.modules.pop(module_name, None)
        raise
    except SyntaxError as e:
        sys.modules.pop(module_name, None)
        where = f"{e.filename or path}:{e.lineno}" if e.lineno else str(e.filename or path)
        msg = f"{where}: syntax error: {e.msg}; fix the Python syntax there"
        raise PipelineFileError(msg) from None
    except ImportError as e:
        sys.modules.pop(module_name, None)
        what = f"No module named {e.name!r}" if isinstance(e, ModuleNotFoundError) else str(e)
        msg = (
            f"{_where(e, path)}: import failed ({what}); install the missing package in this "
            "environment or fix the import"
        )
        raise PipelineFileError(msg) from None
    except (KeyboardInterrupt, SystemExit):
        sys.modules.pop(module_name, None)
        raise
    except BaseException as e:
        sys.modules.pop(module_name, None)
        msg = (
            f"{_where(e, path)}: {type(e).__name__}: {e} (raised while loading the pipeline "
            "file); fix the code there"
        )
        raise PipelineFileError(msg) from None
    cloudpickle.register_pickle_by_value(module)
    return module


def _module_name(path: Path) -> str:
    # Unique per file, so two pipeline files with the same name do not replace each other.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:8]
    stem = re.sub(r"\W", "_", path.stem)
    return f"_cdcflow_pipeline_{stem}_{digest}"


def _where(error: BaseException, path: Path) -> str:
    """``file:line`` of the innermost frame of ``error`` inside the pipeline file."""
    line = None
    for frame in traceback.extract_tb(error.__traceback__):
        if Path(frame.filename) == path:
            line = frame.lineno
    return f"{path}:{line}" if line is not None else str(path)


def _pick_named(module: types.ModuleType, path: Path, name: str) -> Pipeline:
    if not hasattr(module, name):
        found = ", ".join(_candidate_names(module)) or "none"
        msg = f"{path} has no {name!r}; pick one of its pipelines ({found})"
        raise PipelineFileError(msg)
    value = getattr(module, name)
    if isinstance(value, Pipeline):
        return value
    if callable(value):
        return _call_factory(value, path, name)
    msg = f"{path}:{name} is a {type(value).__name__}, not a Pipeline or a function returning one"
    raise PipelineFileError(msg)


def _pick_default(module: types.ModuleType, path: Path) -> Pipeline:
    instances: dict[int, tuple[str, Pipeline]] = {}
    for attr, value in vars(module).items():
        if isinstance(value, Pipeline) and not attr.startswith("_"):
            instances.setdefault(id(value), (attr, value))
    if len(instances) == 1:
        return next(iter(instances.values()))[1]
    if len(instances) > 1:
        names = sorted(attr for attr, _ in instances.values())
        msg = (
            f"{path} defines {len(names)} pipelines ({', '.join(names)}); pick one with "
            f"{path}:{names[0]}"
        )
        raise PipelineFileError(msg)
    factories = _factories(module)
    if len(factories) == 1:
        attr, fn = factories[0]
        return _call_factory(fn, path, attr)
    if len(factories) > 1:
        names = [attr for attr, _ in factories]
        msg = (
            f"{path} has {len(names)} functions returning a Pipeline ({', '.join(names)}); "
            f"pick one with {path}:{names[0]}"
        )
        raise PipelineFileError(msg)
    msg = (
        f"{path} defines no Pipeline; add a module-level `pipeline = cf.Pipeline(\"name\")` "
        "(or a function `def build() -> cf.Pipeline`), or pick one with FILE:NAME"
    )
    raise PipelineFileError(msg)


def _factories(module: types.ModuleType) -> list[tuple[str, Callable[[], Any]]]:
    """Zero-argument functions defined in the file that say they build a Pipeline."""
    out: list[tuple[str, Callable[[], Any]]] = []
    for attr, value in sorted(vars(module).items()):
        if not inspect.isfunction(value) or value.__module__ != module.__name__:
            continue
        if attr.startswith("_") or not _takes_no_arguments(value):
            continue
        if attr in PIPELINE_FUNCTION_NAMES or _returns_pipeline(value):
            out.append((attr, value))
    return out


def _candidate_names(module: types.ModuleType) -> list[str]:
    names = [a for a, v in vars(module).items() if isinstance(v, Pipeline)]
    return sorted(names + [a for a, _ in _factories(module)])


def _takes_no_arguments(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return all(
        p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params
    )


def _returns_pipeline(fn: Callable[..., Any]) -> bool:
    annotation = getattr(fn, "__annotations__", {}).get("return")
    if annotation is Pipeline:
        return True
    return isinstance(annotation, str) and annotation.rpartition(".")[2] == "Pipeline"


def _call_factory(fn: Callable[..., Any], path: Path, name: str) -> Pipeline:
    if not _takes_no_arguments(fn):
        msg = f"{path}:{name} needs arguments; a pipeline function must take none"
        raise PipelineFileError(msg)
    try:
        value = fn()
    except UserInputError:
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:
        msg = f"{_where(e, path.resolve())}: {type(e).__name__}: {e} (raised by {name}()); fix it"
        raise PipelineFileError(msg) from None
    if not isinstance(value, Pipeline):
        msg = f"{path}:{name}() returned {type(value).__name__}; make it return the Pipeline"
        raise PipelineFileError(msg)
    return value
