"""load_pipeline: pipeline files as users write them, and every way they go wrong."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import cloudpickle
import pytest

from cdcflow.errors import DuplicateLabelError, PipelineFileError
from cdcflow.loader import load_pipeline, split_target
from cdcflow.pipeline import Pipeline

SOURCE = (
    'cf.DetectPartitions(database="projects/p/instances/i/databases/d", stream="S")'
)


def write(tmp_path: Path, body: str, name: str = "pipe.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def test_module_level_pipeline(tmp_path: Path) -> None:
    path = write(tmp_path, f"""
        import cdcflow as cf
        pipeline = cf.Pipeline("orders")
        pipeline | {SOURCE} | cf.ReadPartition() | "double" >> cf.Map(lambda r: r)
        alias = pipeline  # the same object under two names is one pipeline
    """)
    p = load_pipeline(path)
    assert isinstance(p, Pipeline)
    assert p.name == "orders"
    assert "double" in p.graph


def test_function_returning_pipeline(tmp_path: Path) -> None:
    path = write(tmp_path, f"""
        import cdcflow as cf
        def helper(x):
            return x
        def build() -> cf.Pipeline:
            p = cf.Pipeline("built")
            p | {SOURCE} | cf.ReadPartition() | cf.Map(helper)
            return p
    """)
    assert load_pipeline(path).name == "built"


def test_unannotated_function_named_pipeline(tmp_path: Path) -> None:
    path = write(tmp_path, """
        import cdcflow as cf
        def build_pipeline():
            return cf.Pipeline("by-name")
        def main():
            raise SystemExit("main must not be called")
    """)
    assert load_pipeline(path).name == "by-name"


def test_several_pipelines_need_a_name(tmp_path: Path) -> None:
    path = write(tmp_path, """
        import cdcflow as cf
        first = cf.Pipeline("first")
        second = cf.Pipeline("second")
    """)
    with pytest.raises(PipelineFileError) as info:
        load_pipeline(path)
    message = str(info.value)
    assert "first, second" in message
    assert f"{path}:first" in message
    assert load_pipeline(f"{path}:second").name == "second"


def test_name_may_pick_any_zero_argument_function(tmp_path: Path) -> None:
    path = write(tmp_path, """
        import cdcflow as cf
        def staging():
            return cf.Pipeline("staging")
        def production():
            return cf.Pipeline("production")
    """)
    assert load_pipeline(f"{path}:production").name == "production"


def test_unknown_name(tmp_path: Path) -> None:
    path = write(tmp_path, 'import cdcflow as cf\np = cf.Pipeline("x")\n')
    with pytest.raises(PipelineFileError, match=r"has no 'nope'.*\(p\)"):
        load_pipeline(f"{path}:nope")


def test_named_function_must_return_a_pipeline(tmp_path: Path) -> None:
    path = write(tmp_path, "def f():\n    return 42\n")
    with pytest.raises(PipelineFileError, match=r"f\(\) returned int"):
        load_pipeline(f"{path}:f")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PipelineFileError, match="not found; check the path"):
        load_pipeline(tmp_path / "nope.py")


def test_directory(tmp_path: Path) -> None:
    with pytest.raises(PipelineFileError, match="is a directory"):
        load_pipeline(tmp_path)


def test_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "import cdcflow as cf\n\np = cf.Pipeline('x'\nq = 1\n")
    with pytest.raises(PipelineFileError) as info:
        load_pipeline(path)
    assert f"{path.resolve()}:3" in str(info.value)
    assert "syntax error" in str(info.value)


def test_import_error_names_module_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "import cdcflow as cf\nimport no_such_module_xyz\n")
    with pytest.raises(PipelineFileError) as info:
        load_pipeline(path)
    message = str(info.value)
    assert "no_such_module_xyz" in message
    assert f"{path.resolve()}:2" in message
    assert "install" in message


def test_error_while_building(tmp_path: Path) -> None:
    path = write(tmp_path, "import cdcflow as cf\np = cf.Pipeline('x')\nundefined_name\n")
    with pytest.raises(PipelineFileError, match=r":3: NameError"):
        load_pipeline(path)


def test_no_pipeline(tmp_path: Path) -> None:
    path = write(tmp_path, "x = 1\n")
    with pytest.raises(PipelineFileError, match="defines no Pipeline"):
        load_pipeline(path)


def test_duplicate_label_passes_through(tmp_path: Path) -> None:
    path = write(tmp_path, f"""
        import cdcflow as cf
        p = cf.Pipeline("dup")
        r = p | {SOURCE} | cf.ReadPartition()
        r | "same" >> cf.Map(str)
        r | "same" >> cf.Map(repr)
    """)
    with pytest.raises(DuplicateLabelError, match="duplicate label 'same'"):
        load_pipeline(path)


def test_imports_modules_next_to_the_file(tmp_path: Path) -> None:
    write(tmp_path, "NAME = 'from-helper'\n", name="helper_mod_for_loader.py")
    path = write(tmp_path, """
        import cdcflow as cf
        from helper_mod_for_loader import NAME
        p = cf.Pipeline(NAME)
    """)
    assert load_pipeline(path).name == "from-helper"


def test_main_block_does_not_run(tmp_path: Path) -> None:
    path = write(tmp_path, """
        import cdcflow as cf
        p = cf.Pipeline("guarded")
        if __name__ == "__main__":
            raise SystemExit("must not run")
    """)
    assert load_pipeline(path).name == "guarded"


def test_functions_travel_by_value(tmp_path: Path) -> None:
    """Spark workers cannot import the file, so its functions must pickle by value."""
    path = write(tmp_path, """
        import cdcflow as cf
        import dataclasses
        @dataclasses.dataclass
        class Row:
            n: int
        def to_row(x):
            return Row(x * 2)
        p = cf.Pipeline("byvalue")
    """)
    load_pipeline(path)
    module = next(m for m in sys.modules.values()
                  if getattr(m, "__file__", None) == str(path.resolve()))
    blob = tmp_path / "fn.pickle"
    blob.write_bytes(cloudpickle.dumps(module.to_row))
    # A fresh interpreter that never loaded the file, like a Spark worker.
    code = f"import pickle; print(pickle.loads(open({str(blob)!r}, 'rb').read())(21).n)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd="/", check=True)
    assert out.stdout.strip() == "42"


def test_split_target(tmp_path: Path) -> None:
    assert split_target("a/b.py:build") == (Path("a/b.py"), "build")
    assert split_target("a/b.py") == (Path("a/b.py"), None)
    assert split_target("a/b.py:not-an-identifier") == (Path("a/b.py:not-an-identifier"), None)
