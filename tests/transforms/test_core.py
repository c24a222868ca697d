"""Map, FlatMap, Filter: outputs, labels, argument checks, pickling."""

from __future__ import annotations

import functools
import os
import pickle
from collections.abc import Iterator
from typing import Any

import cloudpickle
import pytest

from cdcflow.errors import PipelineDefinitionError
from cdcflow.transforms import DoFn, Filter, FlatMap, Map, ParDo
from cdcflow.transforms.core import callable_name


def run(transform: ParDo[Any, Any], elements: list[Any]) -> list[Any]:
    fn = transform.fn
    fn.setup()
    out = [y for x in elements for y in fn.process(x)]
    fn.teardown()
    return out


def double(x: int) -> int:
    return 2 * x


def scale(x: int, factor: int, *, offset: int = 0) -> int:
    return x * factor + offset


def explode(x: int) -> Iterator[int]:
    yield from range(x)


class Rows:
    def to_row(self, x: int) -> dict[str, int]:
        return {"x": x}


class AddOne:
    def __call__(self, x: int) -> int:
        return x + 1


def test_map_emits_one_output_per_element() -> None:
    assert run(Map(double), [1, 2, 3]) == [2, 4, 6]


def test_map_passes_extra_arguments_after_the_element() -> None:
    assert run(Map(scale, 10, offset=1), [1, 2]) == [11, 21]


def test_map_keeps_none_outputs() -> None:
    assert run(Map(lambda x: None), [1, 2]) == [None, None]


def test_flatmap_emits_zero_or_more_outputs() -> None:
    assert run(FlatMap(explode), [0, 1, 3]) == [0, 0, 1, 2]
    assert run(FlatMap(lambda x, n: [x] * n, 2), [7]) == [7, 7]


@pytest.mark.parametrize("bad", ["abc", b"abc", {"a": 1}, None, 5])
def test_flatmap_refuses_a_single_value(bad: Any) -> None:
    with pytest.raises(TypeError, match=f"returned a value of type {type(bad).__name__}.*use Map"):
        run(FlatMap(lambda x: bad), [1])


def test_filter_keeps_truthy_elements() -> None:
    assert run(Filter(lambda x: x % 2), [1, 2, 3, 4]) == [1, 3]
    assert run(Filter(lambda x, lo: x > lo, 2), [1, 2, 3, 4]) == [3, 4]


def test_labels_of_named_functions_and_methods() -> None:
    assert Map(double).default_label() == "Map(double)"
    assert FlatMap(explode).default_label() == "FlatMap(explode)"
    assert Map(Rows().to_row).default_label() == "Map(Rows.to_row)"
    assert Map(str.upper).default_label() == "Map(str.upper)"
    assert Filter(bool).default_label() == "Filter(bool)"
    assert Map(AddOne()).default_label() == "Map(AddOne)"
    assert Map(functools.partial(scale, factor=2)).default_label() == "Map(partial(scale))"


def test_label_of_a_nested_function_is_its_name() -> None:
    def to_row(x: int) -> int:
        return x

    assert Map(to_row).default_label() == "Map(to_row)"


def test_label_of_a_lambda_names_file_and_line() -> None:
    f = Filter(lambda x: x)
    line = test_label_of_a_lambda_names_file_and_line.__code__.co_firstlineno + 1
    assert f.default_label() == f"Filter(<lambda> at test_core.py:{line})"
    assert callable_name(lambda: 0).startswith("<lambda> at test_core.py:")


def test_describe_params_shows_function_and_arguments() -> None:
    assert Map(scale, 10, offset=1).describe_params() == "fn=scale 10 offset=1"
    assert Filter(bool).describe_params() == "fn=bool"
    long = Map(scale, "x" * 100).describe_params()  # type: ignore[arg-type]
    assert long.endswith("...") and len(long) < 60


@pytest.mark.parametrize("cls", [Map, FlatMap, Filter])
@pytest.mark.parametrize("bad", ["to_row", 3, None])
def test_non_callable_is_a_type_error_naming_the_fix(cls: type[ParDo[Any, Any]], bad: Any) -> None:
    with pytest.raises(TypeError, match=rf"{cls.__name__} takes a function.*pass the function"):
        cls(bad)


async def _async_fn(r: int) -> int:
    return r


def _yields(r: int) -> Iterator[int]:
    yield r


@pytest.mark.parametrize("cls", [Map, FlatMap, Filter])
def test_functions_whose_call_runs_nothing_are_refused(cls: type[ParDo[Any, Any]]) -> None:
    """An async function's call gives a coroutine, not its output; a generator function
    belongs in FlatMap (a generator is always truthy to Filter)."""
    with pytest.raises(PipelineDefinitionError, match=r"is an async function.*asyncio\.run"):
        cls(_async_fn)
    if cls is FlatMap:
        assert list(FlatMap(_yields).fn.process(3)) == [3]
        return
    with pytest.raises(PipelineDefinitionError, match=r"is a generator function.*use FlatMap"):
        cls(_yields)


def test_a_dofn_given_to_map_points_to_pardo() -> None:
    class Fn(DoFn[int, int]):
        pass

    with pytest.raises(TypeError, match=r"use ParDo\("):
        Map(Fn())  # type: ignore[arg-type]


def test_pardo_of_a_dofn_uses_setup_and_teardown() -> None:
    class Prefix(DoFn[str, str]):
        def __init__(self) -> None:
            self.prefix = ""

        def setup(self) -> None:
            self.prefix = "p-"

        def process(self, element: str) -> Iterator[str]:
            yield self.prefix + element

    t = ParDo(Prefix())
    assert t.default_label() == "Prefix"
    assert run(t, ["a", "b"]) == ["p-a", "p-b"]


def test_lambdas_and_closures_survive_cloudpickle() -> None:
    factor = 3
    transforms = [
        Map(lambda x: x * factor),
        FlatMap(lambda x: [x, -x]),
        Filter(lambda x: x > 1),
    ]
    restored = [pickle.loads(cloudpickle.dumps(t)) for t in transforms]
    assert [run(t, [1, 2]) for t in restored] == [[3, 6], [1, -1, 2, -2], [2]]
    assert [t.default_label() for t in restored] == [t.default_label() for t in transforms]


def test_lambda_label_uses_the_file_basename_and_lambda_line(tmp_path: Any) -> None:
    # The label does not depend on where the file lives, only on its name and the line.
    path = tmp_path / "pipeline.py"
    path.write_text("from cdcflow.transforms import Filter\nf = Filter(\n    lambda r: r)\n")
    ns: dict[str, Any] = {}
    exec(compile(path.read_text(), os.fspath(path), "exec"), ns)
    assert ns["f"].default_label() == "Filter(<lambda> at pipeline.py:3)"
