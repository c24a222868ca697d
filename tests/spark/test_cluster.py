"""A run on a Spark standalone cluster, submitted the way docs/spark.md says.

A master and a worker (their own JVMs, on loopback) make the cluster; ``spark-submit
--master spark://...`` runs cdcflow's ``__main__.py`` with ``run pipeline.py --runner
spark``. The driver is spark-submit's, the executors are the worker's: the committed files
are the in-memory runner's, byte for byte.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

import cdcflow
from tests.spark.test_runner import cli, committed_files, reference_output, write_pipeline

pytestmark = pytest.mark.spark

SPARK_HOME = Path(__import__("pyspark").__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _env(tmp: Path) -> dict[str, str]:
    return {**os.environ, "SPARK_HOME": str(SPARK_HOME), "SPARK_LOCAL_IP": "127.0.0.1",
            "SPARK_WORKER_DIR": str(tmp / "work"), "SPARK_LOG_DIR": str(tmp / "logs"),
            "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}


def _alive_workers(ui: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{ui}/json/", timeout=2) as answer:
            state = json.load(answer)
    except OSError:
        return 0
    return sum(1 for w in state.get("workers", []) if w.get("state") == "ALIVE")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """(master URL, environment) of a standalone master with one 2-core worker."""
    env = _env(tmp_path)
    port, ui = _free_port(), _free_port()
    spark_class = str(SPARK_HOME / "bin" / "spark-class")
    logs = tmp_path / "cluster.log"
    with logs.open("wb") as log:
        master = subprocess.Popen(
            [spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
             "--port", str(port), "--webui-port", str(ui)],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        url = f"spark://127.0.0.1:{port}"
        worker = subprocess.Popen(
            [spark_class, "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
             "--cores", "2", "--memory", "1g", "--webui-port", str(_free_port()), url],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while _alive_workers(ui) < 1:
            assert time.monotonic() < deadline, logs.read_text()[-3000:]
            assert master.poll() is None and worker.poll() is None, logs.read_text()[-3000:]
            time.sleep(0.5)
        yield url, env
    finally:
        for process in (worker, master):
            process.terminate()
        for process in (worker, master):
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def test_spark_submit_to_a_standalone_cluster_gives_the_in_memory_files(
    tmp_path: Path, cluster: tuple[str, dict[str, str]],
) -> None:
    url, env = cluster
    expected = reference_output(tmp_path)
    path = write_pipeline(tmp_path / "cluster")
    main = str(Path(cdcflow.__file__).parent / "__main__.py")
    run_args = cli(path, "--runner", "spark")[3:]  # what follows `python -m cdcflow`
    submitted = subprocess.run(
        [str(SPARK_HOME / "bin" / "spark-submit"), "--master", url, "--name", "cdcflow-test",
         main, *run_args],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    assert f"master {url}" in submitted.stdout + submitted.stderr
    # the worker ran executors for it (each leaves its log under the worker's directory)
    assert list((tmp_path / "work").glob("app-*/*/stderr"))
    assert committed_files(path.parent / "out") == expected
    assert len(expected) > 20
