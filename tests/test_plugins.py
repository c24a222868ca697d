"""The entry-point registry and cdcflow.transforms.plugin(), with a throwaway distribution.

The fixture writes a real ``*.dist-info`` with an ``entry_points.txt`` and a module into
tmp_path and puts tmp_path on sys.path, which is how an installed package is found.
"""

from __future__ import annotations

import re
import sys
import textwrap
import warnings
from collections.abc import Sequence
from pathlib import Path

import pytest

import cdcflow as cf
from cdcflow.errors import PluginError
from cdcflow.metadata import MemoryStore
from cdcflow.plugins import available, list_plugins, load_plugin
from cdcflow.runners.in_memory import InMemoryRunner
from cdcflow.transforms import Map, Sink, plugin

_MODULE = "_cdcflow_fake_plugin"

_ENTRY_POINTS = f"""
[cdcflow.transforms]
upper = {_MODULE}:Upper
not_a_transform = {_MODULE}:make_number
both = {_MODULE}:Upper

[cdcflow.sinks]
broken = _cdcflow_no_such_module:Nope
lines = {_MODULE}:Lines
both = {_MODULE}:Lines
map_as_sink = {_MODULE}:Upper
number_sink = {_MODULE}:make_number

[cdcflow.runners]
raising = {_MODULE}:RaisingRunner
number = {_MODULE}:NUMBER
not_a_runner = {_MODULE}:NotARunner

[cdcflow.metadata]
bare = {_MODULE}:Bare
raising = {_MODULE}:RaisingStore
odd = {_MODULE}:OddStore
failing = {_MODULE}:FailingStore
"""

_SOURCE = """
from cdcflow.transforms import Map, Sink


def _upper(s):
    return s.upper()


def Upper():
    return Map(_upper)


def make_number():
    return 42


class Lines(Sink):
    def __init__(self, path):
        self.path = path


NUMBER = 42


class RaisingRunner:
    def __init__(self):
        raise RuntimeError("cluster not reachable")


class Bare:
    pass


class RaisingStore:
    @classmethod
    def from_url(cls, url):
        raise ConnectionError("store host down")


class NotARunner:
    pass


class OddStore:
    @classmethod
    def from_url(cls, url):
        return object()


from cdcflow.metadata import MemoryStore


class FailingStore(MemoryStore):
    @classmethod
    def from_url(cls, url):
        return cls()

    def commit_batch(self, *args, **kwargs):
        raise RuntimeError("boom")
"""


@pytest.fixture
def fake_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    info = tmp_path / "cdcflow_fake_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: cdcflow-fake-plugin\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text(textwrap.dedent(_ENTRY_POINTS))
    (tmp_path / f"{_MODULE}.py").write_text(_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, _MODULE, raising=False)
    return tmp_path


def test_available_lists_registered_names(fake_dist: Path) -> None:
    assert {"broken", "lines", "both"} <= set(available("cdcflow.sinks"))
    assert {"upper", "both"} <= set(available("cdcflow.transforms"))
    assert available("cdcflow.sinks") == sorted(available("cdcflow.sinks"))


def test_list_plugins_warns_about_a_broken_plugin_instead_of_crashing(fake_dist: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        infos = list_plugins()
    said = [str(w.message) for w in caught]
    assert any(re.search(r"plugin 'broken' .*is broken: ModuleNotFoundError", s) for s in said)
    assert any("plugin 'number' (_cdcflow_fake_plugin:NUMBER) is broken" in s for s in said)
    ours = {(i.group, i.name): i for i in infos if i.distribution == "cdcflow-fake-plugin"}
    broken = ours["cdcflow.sinks", "broken"]
    assert broken.error is not None and "_cdcflow_no_such_module" in broken.error
    assert broken.value == "_cdcflow_no_such_module:Nope"
    assert ours["cdcflow.sinks", "lines"].error is None
    assert ours["cdcflow.transforms", "upper"].error is None
    # what loads but cannot be what its group holds is listed as broken too
    assert ours["cdcflow.runners", "number"].error == "42 is not a class or factory"
    assert "has no from_url(url) classmethod" in str(ours["cdcflow.metadata", "bare"].error)
    assert ours["cdcflow.metadata", "raising"].error is None


def test_list_plugins_without_loading_does_not_import(fake_dist: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        infos = list_plugins(load=False)
    assert all(i.error is None for i in infos)
    assert _MODULE not in sys.modules


def test_load_plugin_returns_the_registered_object(fake_dist: Path) -> None:
    lines = load_plugin("cdcflow.sinks", "lines")
    assert issubclass(lines, Sink)
    assert lines.__module__ == _MODULE


def test_load_plugin_of_a_broken_plugin_is_a_plugin_error(fake_dist: Path) -> None:
    with pytest.raises(PluginError, match=r"'broken' \(_cdcflow_no_such_module:Nope, package "
                       r"cdcflow-fake-plugin\) failed to load: ModuleNotFoundError: .*; "
                       r"reinstall that package, or uninstall it"):
        load_plugin("cdcflow.sinks", "broken")


def test_load_plugin_unknown_name_lists_what_is_installed(fake_dist: Path) -> None:
    with pytest.raises(PluginError, match=r"no sink named 'kafka'.*installed: .*lines"):
        load_plugin("cdcflow.sinks", "kafka")


def test_unknown_group_names_the_groups() -> None:
    with pytest.raises(PluginError, match=r"unknown plugin group 'cdcflow.things'.*cdcflow.sinks"):
        available("cdcflow.things")


def test_plugin_builds_a_transform_with_arguments(fake_dist: Path) -> None:
    t = plugin("upper")
    assert isinstance(t, Map)
    assert list(t.fn.process("abc")) == ["ABC"]
    sink = plugin("lines", path="out/x")
    assert isinstance(sink, Sink)
    assert sink.path == "out/x"  # type: ignore[attr-defined]


def test_plugin_unknown_name_lists_transforms_and_sinks(fake_dist: Path) -> None:
    with pytest.raises(PluginError) as err:
        plugin("kafka")
    text = str(err.value)
    assert "'kafka'" in text
    assert "transforms: " in text and "upper" in text
    assert "sinks: " in text and "lines" in text
    assert "install the package" in text


def test_plugin_errors_name_the_problem(fake_dist: Path) -> None:
    with pytest.raises(PluginError, match="failed to load"):
        plugin("broken")
    with pytest.raises(PluginError, match=r"both as a transform and as a sink.*import the class"):
        plugin("both")
    with pytest.raises(PluginError, match="built 42, not a transform"):
        plugin("not_a_transform")
    with pytest.raises(PluginError, match=r"under cdcflow.sinks but built .*not a Sink"):
        plugin("map_as_sink")
    with pytest.raises(PluginError, match=r"under cdcflow.sinks but built 42, which is not a "
                                          r"Sink"):
        plugin("number_sink")


def test_runner_and_store_plugins_that_cannot_start_name_the_problem(fake_dist: Path) -> None:
    from cdcflow.errors import StoreSetupError
    from cdcflow.launch import make_runner
    from cdcflow.metadata import open_store

    with pytest.raises(PluginError, match="raising runner could not be made: RuntimeError: "
                                          "cluster not reachable"):
        make_runner("raising", {})
    with pytest.raises(PluginError, match="the runner plugin 'number' is 42, not a Runner"):
        make_runner("number", {})
    with pytest.raises(PluginError, match=r"'bare' .* has no from_url\(url\) classmethod"):
        open_store("bare://x")
    with pytest.raises(StoreSetupError, match="raising://x could not be opened: "
                                              "ConnectionError: store host down"):
        open_store("raising://x")
    # what a plugin makes must be what it stands for (else an AttributeError mid-run)
    with pytest.raises(PluginError, match="not_a_runner runner plugin made NotARunner, not a "
                                          "Runner"):
        make_runner("not_a_runner", {})
    with pytest.raises(PluginError, match=r"returned object, not a MetadataStore"):
        open_store("odd://x")


def test_a_name_two_packages_register_is_refused(fake_dist: Path) -> None:
    other = fake_dist / "cdcflow_other_plugin-0.1.dist-info"
    other.mkdir()
    (other / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: cdcflow-other-plugin\nVersion: 0.1\n")
    (other / "entry_points.txt").write_text(f"[cdcflow.transforms]\nupper = {_MODULE}:Lines\n")
    assert available("cdcflow.transforms").count("upper") == 1
    with pytest.raises(PluginError, match=r"2 installed packages register 'upper' under "
                                          r"cdcflow.transforms: .*uninstall all but one"):
        load_plugin("cdcflow.transforms", "upper")
    listed = [p for p in list_plugins(load=False) if p.name == "upper"]
    assert len(listed) == 2 and all("also registered as" in (p.error or "") for p in listed)


def test_a_package_cannot_take_a_name_of_cdcflow_s_own(
    fake_dist: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plugin under a built-in name (``memory``, ``sqlite``) is ignored with a warning
    and listed as broken; the built-in keeps working (before, the runner refused to start
    and asked to uninstall cdcflow, while the store silently ignored the plugin)."""
    from cdcflow import plugins
    from cdcflow.launch import make_runner
    from cdcflow.metadata import open_store
    from cdcflow.metadata.sqlite import SQLiteStore
    from cdcflow.runners.in_memory import InMemoryRunner

    monkeypatch.setattr(plugins, "_warned", set())
    other = fake_dist / "cdcflow_squatter-0.1.dist-info"
    other.mkdir()
    (other / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: cdcflow-squatter\nVersion: 0.1\n")
    (other / "entry_points.txt").write_text(
        f"[cdcflow.runners]\nmemory = {_MODULE}:NotARunner\n"
        f"[cdcflow.metadata]\nsqlite = {_MODULE}:RaisingStore\n")
    why = r"'memory' is the name of cdcflow's own runner, so this entry point of " \
          r"cdcflow-squatter is ignored: register it under another name"
    assert load_plugin("cdcflow.runners", "memory") is InMemoryRunner
    assert isinstance(make_runner("memory", {})[0], InMemoryRunner)
    assert len(re.findall(why, caplog.text)) == 1  # once per process
    caplog.clear()
    assert isinstance(open_store(f"sqlite:///{fake_dist / 's.db'}"), SQLiteStore)
    assert "'sqlite' is the name of cdcflow's own metadata store, so this entry point of " \
        "cdcflow-squatter is ignored" in caplog.text
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        listed = {(p.group, p.name, p.distribution): p.error for p in list_plugins()}
    assert listed["cdcflow.runners", "memory", "cdcflow"] is None
    assert listed["cdcflow.metadata", "sqlite", "cdcflow"] is None
    assert re.search(why, listed["cdcflow.runners", "memory", "cdcflow-squatter"] or "")
    assert "cdcflow's own metadata store" in (
        listed["cdcflow.metadata", "sqlite", "cdcflow-squatter"] or "")


def test_a_store_plugin_s_own_error_names_the_store_and_the_method(fake_dist: Path) -> None:
    """It said only ``RuntimeError: boom``; the store is used as it is otherwise."""
    import cdcflow as cf
    from cdcflow.engine.loop import Engine, RunOptions
    from cdcflow.metadata import MemoryStore, open_store
    from cdcflow.metadata.base import MetadataStore
    from cdcflow.runners.in_memory import InMemoryRunner
    from cdcflow.testing import ScriptedChangeStream

    store = open_store("failing://x")
    assert isinstance(store, MetadataStore) and store.pipelines() == []
    assert isinstance(open_store("memory://"), MemoryStore)  # cdcflow's own: as it is
    t0 = 10**18
    stream = ScriptedChangeStream("S", partitions=1, origin=t0)
    stream.write("T", 1, "INSERT", {"v": 1}, at=t0 + 1000)
    p = cf.Pipeline("plugged")
    (p | cf.DetectPartitions(stream="S", start_at=t0, end_at=t0 + 10**9, client=stream)
     | cf.ReadPartition() | cf.Collect())
    with pytest.raises(RuntimeError, match="boom") as info:
        Engine(p, store, InMemoryRunner(), RunOptions(batch_interval=0)).run()
    assert "in commit_batch() of the failing:// metadata store (a plugin)" in \
        info.value.__notes__


def test_the_ignored_entry_point_is_one_log_line_of_a_run(fake_dist: Path) -> None:
    """It was a bare line before logging was set up and a log line after: twice, and not
    JSON under --log-format json."""
    import json
    import os
    import subprocess

    other = fake_dist / "cdcflow_squatter-0.1.dist-info"
    other.mkdir()
    (other / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: cdcflow-squatter\nVersion: 0.1\n")
    (other / "entry_points.txt").write_text(f"[cdcflow.runners]\nmemory = {_MODULE}:NotARunner\n")
    (fake_dist / "p.py").write_text(textwrap.dedent("""
        import cdcflow as cf
        from cdcflow.testing import ScriptedChangeStream

        stream = ScriptedChangeStream("S", partitions=1, origin=10**18)
        pipeline = cf.Pipeline("squatted")
        (pipeline | cf.DetectPartitions(stream="S", start_at=10**18, end_at=10**18 + 10**9,
                                        client=stream)
         | cf.ReadPartition() | cf.Collect())
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(fake_dist), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run(
        [sys.executable, "-m", "cdcflow", "--log-format", "json", "run", str(fake_dist / "p.py"),
         "--metadata", "memory://"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [json.loads(line) for line in done.stderr.splitlines()]  # every line is JSON
    said = [r["message"] for r in lines if "cdcflow-squatter is ignored" in r["message"]]
    assert len(said) == 1 and said[0].startswith("plugin _cdcflow_fake_plugin:NotARunner: ")
    # a command that runs no pipeline logs in the format asked for too
    from cdcflow.metadata import SQLiteStore

    (other / "entry_points.txt").write_text(f"[cdcflow.metadata]\nsqlite = {_MODULE}:Bare\n")
    SQLiteStore(fake_dist / "s.db").close()
    done = subprocess.run(
        [sys.executable, "-m", "cdcflow", "--log-format", "json", "status", "--metadata",
         f"sqlite:///{fake_dist / 's.db'}"], capture_output=True, text=True, env=env,
        timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [json.loads(line) for line in done.stderr.splitlines()]
    assert [r["level"] for r in lines if "cdcflow-squatter is ignored" in r["message"]] == [
        "WARNING"]


class _OpenRaising(InMemoryRunner):
    name = "openraise"

    def open(self, app_name: str) -> None:
        raise RuntimeError("cannot start cluster")


class _RunRaising(InMemoryRunner):
    name = "runraise"

    def run_tasks(self, program: bytes, tasks: Sequence[bytes]) -> list[bytes]:
        raise RuntimeError("executors lost")


def test_a_runner_plugin_that_fails_to_open_or_run_names_itself() -> None:
    from cdcflow.engine.loop import Engine, RunOptions
    from cdcflow.testing import ScriptedChangeStream

    def pipeline() -> cf.Pipeline:
        stream = ScriptedChangeStream("S", partitions=1, origin=10**18)
        stream.write("T", 1, "INSERT", {"v": 1}, at=10**18 + 10**9)
        p = cf.Pipeline("runner-plugin")
        (p | cf.DetectPartitions(stream="S", start_at=10**18, end_at=10**18 + 3 * 10**9,
                                 client=stream) | cf.ReadPartition() | cf.Collect())
        return p

    options = RunOptions(batch_interval=0, batch_retries=0)
    with pytest.raises(PluginError, match=r"the runner 'openraise' could not open: "
                                          r"RuntimeError: cannot start cluster; check its"):
        Engine(pipeline(), MemoryStore(), _OpenRaising(), options).run()
    with pytest.raises(RuntimeError, match="executors lost") as info:
        Engine(pipeline(), MemoryStore(), _RunRaising(), options).run()
    assert "in run_tasks() of runner 'runraise'" in info.value.__notes__
