"""Composing pipelines: `|`, `>>` labels, composites, and validation errors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

import cdcflow as cf
from cdcflow.errors import DuplicateLabelError, PipelineDefinitionError
from cdcflow.transforms.base import PCollection, PrimitiveTransform, SinkWriter, WriterContext

DB = "projects/p/instances/i/databases/shop"


class _Sink(cf.Sink):
    """A sink for building graphs; nothing is run in these tests."""

    def open_writer(self, ctx: WriterContext) -> SinkWriter:
        raise AssertionError("graph tests never run a sink")

    def commit(self, batch_id: int, messages: Sequence[Any]) -> None:
        raise AssertionError("graph tests never run a sink")


def to_row(record: Any) -> Any:
    return record


def source() -> cf.DetectPartitions:
    return cf.DetectPartitions(database=DB, stream="Orders")


def records(p: cf.Pipeline) -> PCollection:
    return p | source() | cf.ReadPartition()


def test_pipe_builds_a_linear_dag_in_order() -> None:
    p = cf.Pipeline("orders")
    out = records(p) | cf.Map(to_row) | _Sink()
    assert [(label, t.kind) for label, t in p.nodes()] == [
        ("DetectPartitions", "Source"),
        ("ReadPartition", "Read"),
        ("Map(to_row)", "ParDo"),
        ("_Sink", "Sink"),
    ]
    assert out.producer == "_Sink"
    assert p.upstream("Map(to_row)") == "ReadPartition"
    assert p.upstream("DetectPartitions") is None
    assert p.downstream("ReadPartition") == ["Map(to_row)"]
    p.validate()


def test_a_pcollection_feeds_several_branches() -> None:
    p = cf.Pipeline("orders")
    rows = records(p) | "rows" >> cf.Map(to_row)
    rows | "a" >> _Sink()
    rows | "deletes" >> cf.Filter(lambda r: r) | "b" >> _Sink()
    assert p.downstream("rows") == ["a", "deletes"]
    assert p.labels_of_kind("Sink") == ["a", "b"]
    p.validate()


def test_rshift_labels_a_copy_and_leaves_the_original_alone() -> None:
    m = cf.Map(to_row)
    named = "as rows" >> m
    assert named.label == "as rows"
    assert m.label is None
    p = cf.Pipeline("orders")
    records(p) | named | _Sink()
    assert "as rows" in p.graph
    assert isinstance(p.transform("as rows"), cf.Map)


@pytest.mark.parametrize("bad", ["", "   ", 3])
def test_empty_or_non_string_label_is_refused(bad: Any) -> None:
    with pytest.raises(TypeError, match="non-empty string"):
        cf.Map(to_row).with_label(bad)


def test_lambda_default_label_names_file_and_line() -> None:
    p = cf.Pipeline("orders")
    records(p) | cf.Filter(lambda r: r) | _Sink()
    line = test_lambda_default_label_names_file_and_line.__code__.co_firstlineno + 2
    assert f"Filter(<lambda> at test_pipeline.py:{line})" in p.graph


class _Clean(cf.PTransform):
    """A composite of two steps."""

    def expand(self, pcoll: PCollection) -> PCollection:
        return pcoll | "keep" >> cf.Filter(bool) | cf.Map(to_row)


class _Outer(cf.PTransform):
    def expand(self, pcoll: PCollection) -> PCollection:
        return pcoll | "inner" >> _Clean() | "last" >> cf.Map(to_row)


def test_composite_labels_nest_under_the_composite() -> None:
    p = cf.Pipeline("orders")
    records(p) | _Clean() | "again" >> _Clean() | _Sink()
    assert [label for label, _ in p.nodes()] == [
        "DetectPartitions",
        "ReadPartition",
        "_Clean/keep",
        "_Clean/Map(to_row)",
        "again/keep",
        "again/Map(to_row)",
        "_Sink",
    ]
    assert p.upstream("again/keep") == "_Clean/Map(to_row)"
    p.validate()


def test_nested_composites_nest_their_labels() -> None:
    p = cf.Pipeline("orders")
    records(p) | "outer" >> _Outer() | _Sink()
    labels = [label for label, _ in p.nodes()]
    assert labels[2:] == ["outer/inner/keep", "outer/inner/Map(to_row)", "outer/last", "_Sink"]


def test_duplicate_label_names_the_label_and_the_fix() -> None:
    p = cf.Pipeline("orders")
    rows = records(p) | cf.Map(to_row)
    with pytest.raises(DuplicateLabelError) as err:
        rows | cf.Map(to_row)
    assert "'Map(to_row)'" in str(err.value)
    assert '"Map(to_row) 2" >> Map(...)' in str(err.value)


def test_duplicate_composite_label_is_refused() -> None:
    p = cf.Pipeline("orders")
    rows = records(p) | _Clean()
    with pytest.raises(DuplicateLabelError, match=r"'_Clean'.*\"_Clean 2\" >> _Clean"):
        rows | _Clean()


def test_duplicate_inside_a_composite_suggests_a_leaf_label() -> None:
    class Twice(cf.PTransform):
        def expand(self, pcoll: PCollection) -> PCollection:
            return pcoll | cf.Map(to_row) | cf.Map(to_row)

    p = cf.Pipeline("orders")
    with pytest.raises(DuplicateLabelError) as err:
        records(p) | "t" >> Twice()
    assert "'t/Map(to_row)'" in str(err.value)
    assert '"Map(to_row) 2" >>' in str(err.value)


def test_sink_is_terminal() -> None:
    p = cf.Pipeline("orders")
    written = records(p) | "out" >> _Sink()
    with pytest.raises(PipelineDefinitionError, match="'out' is a sink and sinks are terminal"):
        written | cf.Map(to_row)


def test_applying_a_plain_function_says_to_wrap_it() -> None:
    p = cf.Pipeline("orders")
    rows = records(p)
    with pytest.raises(PipelineDefinitionError, match="wrap plain functions in Map"):
        rows | to_row  # type: ignore[operator]


def test_pcollection_of_another_pipeline_is_refused() -> None:
    rows = records(cf.Pipeline("a"))
    with pytest.raises(PipelineDefinitionError, match="another pipeline"):
        cf.Pipeline("b").apply(cf.Map(to_row), rows)


def test_expand_must_return_a_pcollection() -> None:
    class Broken(cf.PTransform):
        def expand(self, pcoll: PCollection) -> PCollection:
            return None  # type: ignore[return-value]

    p = cf.Pipeline("orders")
    with pytest.raises(PipelineDefinitionError, match="expand\\(\\) must return"):
        records(p) | Broken()


@pytest.mark.parametrize("name", ["", "has space", "-dash-first", "x" * 129, "a/b"])
def test_invalid_pipeline_name(name: str) -> None:
    with pytest.raises(PipelineDefinitionError, match="keys stored progress"):
        cf.Pipeline(name)


# -- validation ------------------------------------------------------------------------------


def test_validate_empty_pipeline() -> None:
    with pytest.raises(PipelineDefinitionError, match=r"empty: start it with pipeline \|"):
        cf.Pipeline("orders").validate()


def test_validate_missing_read_partition() -> None:
    p = cf.Pipeline("orders")
    p | source() | cf.Map(to_row) | _Sink()
    with pytest.raises(PipelineDefinitionError, match=r"put ReadPartition\(\) between them"):
        p.validate()


def test_validate_sink_right_after_source() -> None:
    p = cf.Pipeline("orders")
    p | source() | _Sink()
    with pytest.raises(PipelineDefinitionError, match="'_Sink' is applied to DetectPartitions"):
        p.validate()


def test_validate_read_partition_without_a_source_names_detect_partitions() -> None:
    p = cf.Pipeline("orders")
    p | cf.ReadPartition() | _Sink()
    with pytest.raises(PipelineDefinitionError,
                       match=r"'ReadPartition' has no input: apply it after DetectPartitions"):
        p.validate()


def test_validate_read_partition_in_the_wrong_place() -> None:
    p = cf.Pipeline("orders")
    records(p) | "again" >> cf.ReadPartition() | _Sink()
    with pytest.raises(PipelineDefinitionError, match=r"'again'.*right after DetectPartitions"):
        p.validate()


def test_validate_source_applied_to_records() -> None:
    p = cf.Pipeline("orders")
    records(p) | "second" >> source() | _Sink()
    with pytest.raises(PipelineDefinitionError, match=r"'second'.*applied to the pipeline itself"):
        p.validate()


def test_validate_two_sources() -> None:
    p = cf.Pipeline("orders")
    records(p) | _Sink()
    p | "other" >> source() | "read" >> cf.ReadPartition() | "s2" >> _Sink()
    with pytest.raises(PipelineDefinitionError, match=r"has 2 DetectPartitions.*one pipeline per"):
        p.validate()


def test_validate_two_read_partitions() -> None:
    p = cf.Pipeline("orders")
    partitions = p | source()
    partitions | cf.ReadPartition() | _Sink()
    partitions | "read 2" >> cf.ReadPartition() | "s2" >> _Sink()
    with pytest.raises(PipelineDefinitionError, match="exactly one ReadPartition"):
        p.validate()


def test_validate_no_sink() -> None:
    p = cf.Pipeline("orders")
    records(p) | cf.Map(to_row)
    with pytest.raises(PipelineDefinitionError, match=r"no sink.*WriteFiles\(path\)"):
        p.validate()


class _Window(PrimitiveTransform):
    kind = "Window"


def test_validate_unknown_primitive_kind() -> None:
    p = cf.Pipeline("orders")
    records(p) | _Window() | _Sink()
    with pytest.raises(PipelineDefinitionError, match=r"'_Window'.*kind 'Window'.*ParDo/Map"):
        p.validate()


def test_validate_with_runner_kinds() -> None:
    p = cf.Pipeline("orders")
    records(p) | _Window() | _Sink()
    p.validate(known_kinds=("Source", "Read", "ParDo", "Sink", "Window"))
    with pytest.raises(PipelineDefinitionError, match=r"kind 'ParDo'.*known kinds: Source, Read"):
        q = cf.Pipeline("q")
        records(q) | cf.Map(to_row) | _Sink()
        q.validate(known_kinds=("Source", "Read", "Sink"))


def test_an_error_policy_that_is_not_one_is_refused_where_the_pipeline_is_made() -> None:
    for bad in (5, cf.Skip, cf.Skip()):
        with pytest.raises(PipelineDefinitionError, match="pass an ErrorPolicy"):
            cf.Pipeline("p", error_policy=bad)  # type: ignore[arg-type]


def test_error_policy_defaults_and_override() -> None:
    assert cf.Pipeline("a").error_policy == cf.ErrorPolicy()
    policy = cf.ErrorPolicy(retries=0, then="skip")
    assert cf.Pipeline("a", error_policy=policy).error_policy is policy
