"""Find, start and provision the Cloud Spanner emulator (a local process, no Docker).

The binary ``emulator_main`` ships with the Google Cloud SDK component
``cloud-spanner-emulator`` (Debian package google-cloud-cli-spanner-emulator). It is found
through ``$CDCFLOW_SPANNER_EMULATOR`` (path to emulator_main), then the SDK root that
``gcloud info`` reports, then the usual SDK locations. The emulator keeps no data across
restarts and serves gRPC only.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, NoReturn

from cdcflow.errors import CdcflowError, ConfigurationError, EmulatorNotFoundError

__all__ = [
    "Emulator",
    "EmulatorNotFoundError",
    "check_port_free",
    "emulator_client",
    "find_emulator_binary",
    "free_port",
]

INSTALL_HINT = (
    "install the Cloud Spanner emulator: `apt-get install google-cloud-cli-spanner-emulator` "
    "(or `gcloud components install cloud-spanner-emulator`), or set "
    "CDCFLOW_SPANNER_EMULATOR to the path of emulator_main"
)

_RELATIVE = Path("bin") / "cloud_spanner_emulator" / "emulator_main"
_SDK_ROOTS = ("/usr/lib/google-cloud-sdk", "/usr/share/google-cloud-sdk", "/opt/google-cloud-sdk")


def _sdk_root_from_gcloud() -> Path | None:
    gcloud = shutil.which("gcloud")
    if gcloud is None:
        return None
    try:
        out = subprocess.run(
            [gcloud, "info", "--format=value(installation.sdk_root)"],
            capture_output=True, text=True, timeout=60, check=False,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return Path(out) if out else None


def find_emulator_binary() -> Path:
    """Path of emulator_main; raise EmulatorNotFoundError with install instructions."""
    env = os.environ.get("CDCFLOW_SPANNER_EMULATOR")
    if env:
        path = Path(env)
        if path.is_dir():
            path = path / "emulator_main"
        if path.is_file() and os.access(path, os.X_OK):
            return path
        msg = f"CDCFLOW_SPANNER_EMULATOR={env} is not an executable emulator_main; {INSTALL_HINT}"
        raise EmulatorNotFoundError(msg)
    candidates = [Path(root) / _RELATIVE for root in _SDK_ROOTS]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    root = _sdk_root_from_gcloud()
    if root is not None and (root / _RELATIVE).is_file():
        return root / _RELATIVE
    msg = f"the Cloud Spanner emulator (emulator_main) was not found; {INSTALL_HINT}"
    raise EmulatorNotFoundError(msg)


#: Starts the emulator so that it gets SIGTERM when this process dies (Linux's
#: PR_SET_PDEATHSIG, which lasts across exec), so a killed test session or demo never leaves
#: an emulator behind. It runs in a fresh interpreter: code run between fork and exec in a
#: process with threads (a ``preexec_fn``) may find a lock held by a thread that the fork
#: did not copy, and abort (SIGABRT) or hang before the emulator starts.
_TRAMPOLINE = """
import ctypes, os, signal, sys
try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    os._exit(1)
os.execv(sys.argv[2], sys.argv[2:])
"""


def _with_parent(args: Sequence[str]) -> list[str]:
    """``args`` started so that the process ends with this one (see ``_TRAMPOLINE``)."""
    if not sys.platform.startswith("linux"):
        return list(args)
    return [sys.executable, "-I", "-S", "-c", _TRAMPOLINE, str(os.getpid()), *args]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def check_port_free(port: int) -> None:
    """Raise ConfigurationError unless ``port`` can be bound on 127.0.0.1: the emulator
    would fail to bind it and exit, or (another emulator: gRPC reuses ports) share it,
    each client then reaching one or the other at random."""
    if not 0 < port < 65536:
        msg = f"{port} is not a TCP port: choose one from 1 to 65535 (or none: a free one)"
        raise ConfigurationError(msg)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed port's TIME_WAIT
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            msg = (f"port {port} on 127.0.0.1 is taken ({e.strerror}); choose another port "
                   "(or none: a free one is chosen), or stop what listens there")
            raise ConfigurationError(msg) from None


def emulator_client(host: str, project: str = "test-project") -> Any:
    """A google-cloud-spanner Client talking to the emulator at ``host`` (``127.0.0.1:PORT``)."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import spanner

    return spanner.Client(
        project=project,
        credentials=AnonymousCredentials(),  # type: ignore[no-untyped-call]
        client_options={"api_endpoint": host},
        disable_builtin_metrics=True,
    )


class Emulator:
    """A Cloud Spanner emulator process on a free loopback port.

    ``partition_alive_seconds`` makes change-stream partitions split and merge every N..2N
    seconds instead of 20..40 s, so tests see churn quickly.
    """

    def __init__(
        self,
        *,
        port: int | None = None,
        partition_alive_seconds: int | None = None,
        binary: Path | None = None,
        extra_args: Sequence[str] = (),
        project: str = "test-project",
    ) -> None:
        self.binary = binary or find_emulator_binary()
        self._own_port = not port  # chosen here: a start that fails may choose another
        self.port = port or free_port()
        self.partition_alive_seconds = partition_alive_seconds
        self.extra_args = list(extra_args)
        self.project = project
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None
        self._keep_log = False  # the emulator failed and an error named its log: it stays
        self._client: Any = None

    @property
    def host(self) -> str:
        """``127.0.0.1:PORT``: the value for SPANNER_EMULATOR_HOST."""
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The emulator's process id while it runs (None before start and after stop)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def log_path(self) -> str | None:
        """The emulator's log file while it runs. ``stop`` removes it, unless the emulator
        failed (it exited at start, did not answer, stopped answering): the error then
        names the log, which stays for the user to read."""
        if self._log is None:
            return None
        return str(self._log.name)

    def _failed_log(self) -> str | None:
        """``log_path``, for an error that names it: the log then outlives the emulator."""
        self._keep_log = self._log is not None
        return self.log_path

    def start(self, timeout: float = 60.0, attempts: int = 3) -> Emulator:
        """Start the process and wait until it answers. A process that exits at start (its
        port was taken meanwhile, or the binary aborted) is started again, up to
        ``attempts`` times in all, on a new free port unless the port was given."""
        if not self._own_port:
            check_port_free(self.port)
        attempt = 1
        while True:
            self._spawn()
            died = self._wait_ready(timeout)
            if died is None:
                return self
            if attempt >= attempts:
                raise CdcflowError(died)
            attempt += 1
            self._keep_log = False  # nobody reads what this attempt said
            self._drop_log()
            if self._own_port:
                self.port = free_port()

    def _spawn(self) -> None:
        args = [str(self.binary), f"--host_port={self.host}"]
        if self.partition_alive_seconds:
            args.append(
                f"--override_change_stream_partition_token_alive_seconds="
                f"{self.partition_alive_seconds}"
            )
            # The churner wakes up every 20 s by default; make it follow the partition lifetime.
            interval = max(1, self.partition_alive_seconds // 2)
            args += [
                f"--change_stream_churning_interval={interval}s",
                f"--change_stream_churn_thread_sleep_interval={interval}s",
            ]
        args += self.extra_args
        self._drop_log()  # an earlier start's (kept if its error named it)
        self._keep_log = False
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - lives as long as the process
            prefix="spanner-emulator-", suffix=".log", delete=False
        )
        self._proc = subprocess.Popen(
            _with_parent(args), stdout=self._log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )

    def _wait_ready(self, timeout: float) -> str | None:
        """None once the emulator answers; what happened if its process exited first.
        Raises CdcflowError when it does not answer within ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                return (
                    f"the Spanner emulator exited with code {self._proc.returncode} at start; "
                    f"see its log {self._failed_log()}"
                )
            with contextlib.suppress(OSError), socket.create_connection(
                ("127.0.0.1", self.port), timeout=0.5
            ):
                return None
            time.sleep(0.1)
        log = self._failed_log()
        self.stop()
        msg = (f"the Spanner emulator did not answer on {self.host} within {timeout:.0f}s; "
               f"see its log {log}")
        raise CdcflowError(msg)

    def client(self) -> Any:
        if self._client is None:
            self._client = emulator_client(self.host, self.project)
        return self._client

    def create_instance(self, instance: str = "test-instance") -> Any:
        client = self.client()
        config = f"{client.project_name}/instanceConfigs/emulator-config"
        inst = client.instance(
            instance, configuration_name=config, display_name=instance, node_count=1
        )
        if not inst.exists():
            inst.create().result(120)
        return inst

    def create_database(
        self,
        database: str,
        ddl: Sequence[str] = (),
        *,
        instance: str = "test-instance",
        dialect: Literal["GOOGLE_STANDARD_SQL", "POSTGRESQL"] = "GOOGLE_STANDARD_SQL",
    ) -> Any:
        """Create (or recreate) a database with the given DDL; return the Database handle.

        A name or DDL the emulator refuses raises ConfigurationError with its reason."""
        from google.api_core.exceptions import GoogleAPICallError
        from google.cloud.spanner_admin_database_v1 import DatabaseDialect

        check_database_name(database)
        try:
            inst = self.create_instance(instance)
            if dialect == "POSTGRESQL":
                db = inst.database(database, database_dialect=DatabaseDialect.POSTGRESQL)
                if db.exists():
                    db.drop()
                db.create().result(120)
                if ddl:
                    db.update_ddl(list(ddl)).result(300)
            else:
                db = inst.database(database, ddl_statements=list(ddl))
                if db.exists():
                    db.drop()
                db.create().result(300)
        except GoogleAPICallError as e:
            text = " ".join(str(getattr(e, "message", e)).split())
            msg = f"the emulator refused database {database!r} or its DDL: {text}; fix the DDL"
            raise ConfigurationError(msg) from None
        return db

    def wait_while_answering(self, every: float = 1.0) -> NoReturn:
        """Block while the emulator accepts connections; raise CdcflowError naming its log
        once it stops answering (a KeyboardInterrupt ends the wait as usual)."""
        while True:
            time.sleep(every)
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=2).close()
            except OSError:
                msg = f"the emulator stopped answering on {self.host}; see {self._failed_log()}"
                raise CdcflowError(msg) from None

    def database_path(self, database: str, instance: str = "test-instance") -> str:
        return f"projects/{self.project}/instances/{instance}/databases/{database}"

    def stop(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
            self._client = None
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
        self._proc = None
        self._drop_log()

    def _drop_log(self) -> None:
        """Close the log; remove it unless an error named it (the emulator failed)."""
        if self._log is not None:
            self._log.close()
            if not self._keep_log:
                with contextlib.suppress(OSError):
                    os.unlink(self._log.name)
            self._log = None

    def __enter__(self) -> Emulator:
        return self.start() if self._proc is None else self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


@contextlib.contextmanager
def running_emulator(**kwargs: Any) -> Iterator[Emulator]:
    """``with running_emulator(partition_alive_seconds=2) as emu: ...``"""
    emu = Emulator(**kwargs).start()
    try:
        yield emu
    finally:
        emu.stop()


_DATABASE_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,28}[a-z0-9]$")


def check_database_name(name: str) -> None:
    """Raise ConfigurationError unless ``name`` is a valid Spanner database id."""
    if not _DATABASE_NAME.match(name):
        msg = (
            f"database name {name!r} is not valid: use 2-30 characters, lowercase letters, "
            "digits, '_' or '-', starting with a letter and not ending with '_' or '-'"
        )
        raise ConfigurationError(msg)
