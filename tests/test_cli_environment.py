"""A bad environment gets one line naming the fix, exit 2, within seconds: missing
credentials, a closed port, an unknown instance, a DDL or database name the emulator
refuses."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cdcflow.spanner.emulator import Emulator


def _cdcflow(
    *args: str, cwd: Path, env: dict[str, str]
) -> tuple[subprocess.CompletedProcess[str], float]:
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "cdcflow", *args], capture_output=True, text=True, timeout=120,
        cwd=cwd, env=env, stdin=subprocess.DEVNULL,
    )
    return done, time.monotonic() - began


def _pipeline(tmp_path: Path, database: str) -> Path:
    path = tmp_path / "p.py"
    path.write_text(textwrap.dedent(f"""
        import cdcflow as cf
        pipeline = cf.Pipeline("env")
        (pipeline | cf.DetectPartitions(database="{database}", stream="S")
         | cf.ReadPartition() | cf.Print())
    """))
    return path


def _error_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("cdcflow: error:")]
    assert len(errors) == 1, done.stderr
    assert "Traceback" not in done.stderr
    return errors[0]


def _env(**changes: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CDCFLOW_DEBUG",)}
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def test_missing_credentials_ask_about_the_emulator_variable(tmp_path: Path) -> None:
    path = _pipeline(tmp_path, "projects/p/instances/i/databases/d")
    home = tmp_path / "home"  # no gcloud application-default credentials there
    home.mkdir()
    done, took = _cdcflow("run", str(path), "--for", "3s", cwd=tmp_path, env=_env(
        SPANNER_EMULATOR_HOST=None, GOOGLE_APPLICATION_CREDENTIALS=None, HOME=str(home),
        CLOUDSDK_CONFIG=str(home / "gcloud"),
    ))
    line = _error_line(done)
    assert "SPANNER_EMULATOR_HOST exported" in line and took < 10


def test_a_closed_port_fails_within_seconds_naming_the_endpoint(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = _pipeline(tmp_path, "projects/p/instances/i/databases/d")
    done, took = _cdcflow("run", str(path), "--for", "3s", cwd=tmp_path,
                          env=_env(SPANNER_EMULATOR_HOST=f"127.0.0.1:{port}"))
    line = _error_line(done)
    assert f"cannot reach the emulator at 127.0.0.1:{port}" in line and took < 10
    assert "connecting to projects/p/instances/i/databases/d" in done.stderr


def test_an_unknown_host_fails_as_a_closed_port_does(tmp_path: Path) -> None:
    """A mistyped emulator host ended as an outage (exit 1, "Spanner kept failing after 6
    attempts"); a closed port as a configuration error (exit 2): now both are the latter."""
    path = _pipeline(tmp_path, "projects/p/instances/i/databases/d")
    done, took = _cdcflow("run", str(path), "--for", "3s", cwd=tmp_path,
                          env=_env(SPANNER_EMULATOR_HOST="nohost.invalid:1"))
    line = _error_line(done)
    assert "cannot reach the emulator at nohost.invalid:1" in line and took < 15
    assert "is the host:port right?" in line


def test_an_emulator_host_with_a_scheme_is_named_with_the_value_to_export(
    tmp_path: Path,
) -> None:
    path = _pipeline(tmp_path, "projects/p/instances/i/databases/d")
    done, _ = _cdcflow("run", str(path), "--for", "3s", cwd=tmp_path,
                       env=_env(SPANNER_EMULATOR_HOST="http://127.0.0.1:1/"))
    line = _error_line(done)
    assert "has a scheme" in line and "export SPANNER_EMULATOR_HOST=127.0.0.1:1)" in line
    assert "Warning" not in done.stderr  # the client's warning came first, on two lines


@pytest.mark.emulator
def test_an_unknown_instance_is_a_configuration_error(
    tmp_path: Path, spanner_emulator: Emulator
) -> None:
    database = f"projects/{spanner_emulator.project}/instances/nowhere/databases/dd"
    done, _ = _cdcflow("run", str(_pipeline(tmp_path, database)), "--for", "3s", cwd=tmp_path,
                       env=_env(SPANNER_EMULATOR_HOST=spanner_emulator.host))
    assert "instance of" in _error_line(done) and "does not exist" in done.stderr


@pytest.mark.emulator
def test_emulator_start_refuses_bad_ddl_and_bad_names_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "bad.sql").write_text("CREATE TABLEX T (id INT64) PRIMARY KEY (id);\n")
    done, _ = _cdcflow("emulator", "start", "--database", "shop", "--ddl-file", "bad.sql",
                       cwd=tmp_path, env=_env())
    assert "refused database 'shop'" in _error_line(done) and "TABLEX" in done.stderr
    # no address of an emulator that is gone on stdout (a script would take it)
    assert "SPANNER_EMULATOR_HOST" not in done.stdout
    done, took = _cdcflow("emulator", "start", "--database", "Bad-Name!", cwd=tmp_path,
                          env=_env())
    assert "database name 'Bad-Name!' is not valid" in _error_line(done) and took < 10


def test_a_sqlite_store_that_cannot_be_opened_is_one_line_and_exit_2(tmp_path: Path) -> None:
    path = _pipeline(tmp_path, "projects/p/instances/i/databases/d")
    (tmp_path / "a-directory").mkdir()
    (tmp_path / "not-sqlite.db").write_bytes(b"these are not the bytes of a database" * 100)
    for where, says in (("a-directory", "cannot open the SQLite store"),
                        ("not-sqlite.db", "is not a usable SQLite database")):
        done, _ = _cdcflow("run", str(path), "--for", "3s", "--metadata",
                           f"sqlite:///{tmp_path / where}", cwd=tmp_path, env=_env())
        assert says in _error_line(done)


def test_a_default_store_that_cannot_be_made_or_an_empty_url_is_one_line_and_exit_2(
    tmp_path: Path,
) -> None:
    """The default store beside the pipeline file cannot be made (a read-only image, here
    a file where its folder goes): one line naming --metadata, not a bare OSError. An
    empty --metadata ("$UNSET") is refused, not taken for the default."""
    path = _pipeline(tmp_path, "projects/p/instances/i/databases/d")
    (tmp_path / ".cdcflow").write_text("")
    done, _ = _cdcflow("run", str(path), "--for", "3s", cwd=tmp_path, env=_env())
    line = _error_line(done)
    assert "cannot create the directory of the SQLite store" in line
    assert "--metadata sqlite:///PATH" in line
    (tmp_path / ".cdcflow").unlink()
    for command in (("run", str(path), "--for", "3s"), ("status",)):
        done, _ = _cdcflow(*command, "--metadata", "", cwd=tmp_path, env=_env())
        line = _error_line(done)
        assert "not a metadata store URL" in line and "''" in line
    assert not (tmp_path / ".cdcflow").exists()


def test_a_spanner_store_that_does_not_answer_is_one_line_and_exit_2(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done, _ = _cdcflow("status", "--metadata", "spanner://projects/test-project/instances/test-instance/databases/meta",
                       cwd=tmp_path, env=_env(SPANNER_EMULATOR_HOST=f"127.0.0.1:{port}"))
    line = _error_line(done)
    assert f"cannot reach the emulator at 127.0.0.1:{port}" in line
    assert "spanner://projects/test-project/instances/test-instance/databases/meta" in line
    # one line: no warning first of retries (at most 1000 attempts or 120s) it did not make
    assert done.stderr.strip() == line, done.stderr


def test_a_spanner_store_without_credentials_names_the_fix(tmp_path: Path) -> None:
    """``status`` and ``metadata init`` on a Spanner store with neither the emulator
    variable nor credentials: "DefaultCredentialsError: ...; --debug shows the traceback",
    exit 1; now the line ``run`` gives (is SPANNER_EMULATOR_HOST exported?), exit 2."""
    home = tmp_path / "home"
    home.mkdir()
    env = _env(SPANNER_EMULATOR_HOST=None, GOOGLE_APPLICATION_CREDENTIALS=None,
               HOME=str(home), CLOUDSDK_CONFIG=str(home / "gcloud"))
    url = "spanner://projects/test-project/instances/test-instance/databases/meta"
    for command in (("status", "--metadata", url), ("metadata", "init", url)):
        done, _ = _cdcflow(*command, cwd=tmp_path, env=env)
        assert "SPANNER_EMULATOR_HOST exported" in _error_line(done), command
