"""One exception hierarchy: every exception class of cdcflow lives in cdcflow.errors.

The package is walked with pkgutil and every module's source parsed with ast, so a class
defined anywhere (also inside a function) is found; its bases are resolved in the
module's namespace to tell exceptions from other classes.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import cdcflow
from cdcflow import errors
from cdcflow.errors import (
    CdcflowError,
    ChangeStreamError,
    ConfigurationError,
    DecodeError,
    EmulatorNotFoundError,
    SparkTaskError,
    UserInputError,
)


def _modules() -> list[str]:
    names = ["cdcflow"]
    names += [m.name for m in pkgutil.walk_packages(cdcflow.__path__, prefix="cdcflow.")]
    return sorted(names)


def _class_defs(module: str) -> list[ast.ClassDef]:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    if not spec.origin.endswith(".py"):  # the compiled module defines no class
        return []
    tree = ast.parse(Path(spec.origin).read_text(), filename=spec.origin)
    return [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]


def _is_exception(module: str, node: ast.ClassDef) -> bool:
    """Whether a base of ``node`` is an exception class, resolved in ``module``'s globals."""
    namespace = vars(importlib.import_module(module))
    for base in node.bases:
        text = ast.unparse(base)
        try:
            value = eval(text, namespace)  # a name or dotted name of the module's globals
        except NameError:
            msg = (
                f"{module}.{node.name}: base {text!r} is not a module-level name; "
                "teach this test to resolve it"
            )
            raise AssertionError(msg) from None
        if inspect.isclass(value) and issubclass(value, BaseException):
            return True
    return False


def test_the_walk_sees_the_whole_package() -> None:
    modules = _modules()
    assert {"cdcflow.errors", "cdcflow.cli", "cdcflow.spark.runner", "cdcflow.spanner.decode",
            "cdcflow.engine.loop", "cdcflow.transforms.sinks"} <= set(modules)
    defined = {node.name for node in _class_defs("cdcflow.errors")}
    assert {"CdcflowError", "DecodeError", "EmulatorNotFoundError"} <= defined


def test_every_exception_class_is_defined_in_errors() -> None:
    elsewhere = [
        f"{module}.{node.name}"
        for module in _modules()
        if module != "cdcflow.errors"
        for node in _class_defs(module)
        if _is_exception(module, node)
    ]
    assert elsewhere == []


def test_every_exception_in_errors_is_a_public_cdcflow_error() -> None:
    classes = {
        node.name: getattr(errors, node.name)
        for node in _class_defs("cdcflow.errors")
        if _is_exception("cdcflow.errors", node)
    }
    assert len(classes) >= 20
    # and the few helpers beside them (describe, log_failure, user_code) are functions
    assert sorted(classes) == sorted(n for n in errors.__all__
                                     if isinstance(getattr(errors, n), type))
    assert all(callable(getattr(errors, n)) for n in errors.__all__)
    for name, cls in classes.items():
        assert issubclass(cls, CdcflowError), name
        assert cls.__module__ == "cdcflow.errors", name
        assert cls.__doc__, f"{name} needs a docstring saying when it is raised"


def test_the_moved_exceptions_keep_their_old_homes_and_take_their_bases() -> None:
    from cdcflow.spanner import decode, emulator
    from cdcflow.spark import runner

    assert emulator.EmulatorNotFoundError is EmulatorNotFoundError
    assert decode.DecodeError is DecodeError
    assert runner.SparkTaskError is SparkTaskError
    assert issubclass(EmulatorNotFoundError, ConfigurationError)
    assert issubclass(ConfigurationError, UserInputError)
    assert issubclass(DecodeError, ChangeStreamError)
    assert issubclass(DecodeError, ValueError)  # what it was before: old handlers still match
    assert issubclass(SparkTaskError, CdcflowError)
    assert not issubclass(SparkTaskError, UserInputError)


def test_a_decode_error_names_the_fix() -> None:
    from cdcflow.spanner.decode import row_decoder

    class _Type:  # a result column of a type no change stream has (INT64)
        code = 2

    with pytest.raises(DecodeError, match="upgrade cdcflow"):
        row_decoder(_Type())


def test_a_missing_emulator_is_one_line_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cdcflow.spanner.emulator import find_emulator_binary

    missing = tmp_path / "nowhere" / "emulator_main"
    env = {**os.environ, "CDCFLOW_SPANNER_EMULATOR": str(missing)}
    env.pop("CDCFLOW_DEBUG", None)
    result = subprocess.run(
        [sys.executable, "-m", "cdcflow", "emulator", "start"],
        capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("cdcflow: error: CDCFLOW_SPANNER_EMULATOR=")
    assert "apt-get install google-cloud-cli-spanner-emulator" in line
    # outside the CLI it is the same user error, raised as such
    monkeypatch.setenv("CDCFLOW_SPANNER_EMULATOR", str(missing))
    with pytest.raises(UserInputError, match="not an executable emulator_main"):
        find_emulator_binary()


def test_describe_names_an_exception_whose_message_cannot_be_made() -> None:
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no text")

    assert errors.describe(ValueError("bad 3")) == "ValueError: bad 3"
    assert errors.describe(Unprintable()) == "Unprintable (its message could not be printed)"


def test_caused_by_follows_causes_and_contexts_and_stops_at_a_cycle() -> None:
    from cdcflow.errors import caused_by

    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as inner:
            raise ConnectionResetError("reset") from inner
    except ConnectionResetError as exc:
        outer = exc
    assert caused_by(outer, KeyboardInterrupt) and caused_by(outer, (ValueError, OSError))
    assert not caused_by(outer, ValueError)
    a, b = ValueError("a"), TypeError("b")
    a.__context__, b.__context__ = b, a  # a cycle
    assert caused_by(a, TypeError) and not caused_by(a, KeyError)
