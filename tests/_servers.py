"""Start and stop real Redis, PostgreSQL and MariaDB servers on loopback for tests.

Stdlib only. Every server started by this process is stopped (and its
temporary directory removed) at interpreter exit or on SIGTERM.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Protocol, Self

__all__ = [
    "MySQLServer",
    "PostgresServer",
    "RedisCluster",
    "RedisServer",
    "ServerError",
    "free_port",
]

_HOST = "127.0.0.1"
_START_TIMEOUT = 10.0
_STOP_TIMEOUT = 5.0
_PG_USER_CANDIDATES = ("postgres", "retrysafe-pg")
# The last name is created when none exists (one fallback account for both servers).
_MYSQL_USER_CANDIDATES = ("mysql", "retrysafe-pg")
_MYSQL_START_TIMEOUT = 60.0  # mariadbd on a busy 2-core machine: InnoDB recovery, no cache
_MYSQL_STOP_TIMEOUT = 60.0  # a clean InnoDB shutdown flushes the buffer pool


class ServerError(RuntimeError):
    """A test server failed to start or stop."""


class _Stoppable(Protocol):
    def close(self) -> None: ...


_live: list[_Stoppable] = []
_live_lock = threading.Lock()
_hooks_installed = False


def _close_all() -> None:
    with _live_lock:
        servers = list(reversed(_live))
    for server in servers:
        with contextlib.suppress(Exception):
            server.close()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    _close_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _track(server: _Stoppable) -> None:
    global _hooks_installed
    with _live_lock:
        if server not in _live:
            _live.append(server)
        if _hooks_installed:
            return
        _hooks_installed = True
    atexit.register(_close_all)
    if threading.current_thread() is threading.main_thread() and (
        signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    ):
        signal.signal(signal.SIGTERM, _on_sigterm)


def _untrack(server: _Stoppable) -> None:
    with _live_lock:
        if server in _live:
            _live.remove(server)


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_HOST, 0))
        return int(sock.getsockname()[1])


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"<no log at {path}: {exc}>"
    return "\n".join(text.splitlines()[-lines:])


def _end(proc: subprocess.Popen[bytes] | None, timeout: float) -> None:
    """SIGTERM ``proc`` if it runs, and SIGKILL it if it is still there after ``timeout``."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class _Server:
    """What both servers share: a port, start/stop/close, and ``with`` to start and close."""

    def __init__(self, port: int | None) -> None:
        self._auto_port = port is None  # a port we chose may be retried with another
        self._port = port if port is not None else free_port()

    @property
    def port(self) -> int:
        """TCP port the server listens on."""
        return self._port

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def restart(self) -> None:
        """Stop and start again on the same port, keeping the data directory."""
        self.stop()
        self.start()

    def cleanup(self) -> None:
        self.close()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class RedisServer(_Server):
    """A throwaway ``redis-server`` on 127.0.0.1.

    ``durable=True`` turns on the append-only file with an fsync per write, as a
    production store of idempotency records is configured, so that data
    survives :meth:`restart`.
    """

    def __init__(
        self, port: int | None = None, *, durable: bool = False, extra: Sequence[str] = ()
    ) -> None:
        super().__init__(port)
        self.durable = durable
        self.extra = list(extra)  # more redis-server options, e.g. cluster mode
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Connection URL for database 0."""
        return f"redis://{_HOST}:{self._port}/0"

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def log_path(self) -> Path | None:
        """Path of the server's stdout/stderr log, once started."""
        return None if self._dir is None else self._dir / "redis.log"

    def start(self) -> None:
        """Start the server and wait until it answers PING."""
        if self.running:
            return
        exe = shutil.which("redis-server")
        if exe is None:
            raise ServerError("redis-server not found on PATH")
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="retrysafe-redis-"))
        _track(self)
        # An automatically chosen port may be taken between free_port() and
        # bind(); retry with a fresh one, but only before the first success.
        attempts = 3 if self._auto_port else 1
        for attempt in range(attempts):
            try:
                self._spawn(exe)
                break
            except ServerError:
                if attempt == attempts - 1:
                    raise
                self._port = free_port()
        self._auto_port = False

    def _spawn(self, exe: str) -> None:
        assert self._dir is not None
        log_path = self._dir / "redis.log"
        cmd = [
            exe,
            "--port",
            str(self._port),
            "--bind",
            _HOST,
            "--save",
            "",
            "--appendonly",
            "yes" if self.durable else "no",
            "--appendfsync",
            "always",
            "--daemonize",
            "no",
            "--dir",
            str(self._dir),
            *self.extra,
        ]
        with open(log_path, "ab") as log:
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self._dir,
            )
        deadline = time.monotonic() + _START_TIMEOUT
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            if self._ping():
                return
            time.sleep(0.02)
        self._terminate()
        raise ServerError(
            f"redis-server on port {self._port} did not answer PING within "
            f"{_START_TIMEOUT:.0f}s; log tail:\n{_log_tail(log_path)}"
        )

    def _ping(self) -> bool:
        try:
            with socket.create_connection((_HOST, self._port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def _terminate(self) -> None:
        proc, self._proc = self._proc, None
        _end(proc, _STOP_TIMEOUT)

    def stop(self) -> None:
        """Stop the server (SIGTERM, SIGKILL after 5s); keep its directory."""
        self._terminate()

    def kill(self) -> None:
        """SIGKILL the server, as a crash would; keep its directory for :meth:`start`."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        """Stop the server and remove its temporary directory."""
        self._terminate()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        _untrack(self)


class RedisCluster:
    """A throwaway Redis Cluster on loopback: ``masters`` primaries, ``replicas`` each.

    Every node is a :class:`RedisServer` with ``--cluster-enabled yes``; ``redis-cli
    --cluster create`` splits the slots. ``node_timeout`` (ms) is how long the others
    wait before failing a silent primary over to its replica. A node SIGKILLed with
    :meth:`RedisServer.kill` and started again rejoins (its ``nodes.conf`` is kept).
    """

    def __init__(self, masters: int = 3, replicas: int = 1, *, node_timeout: int = 1000) -> None:
        self.replicas = replicas
        self.nodes = [
            RedisServer(
                extra=[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-node-timeout",
                    str(node_timeout),
                    "--cluster-port",
                    str(free_port()),
                ]
            )
            for _ in range(masters * (1 + replicas))
        ]
        # (--cluster-port: the default, port + 10000, may be past 65535.)

    @property
    def url(self) -> str:
        """A ``redis+cluster://`` URL naming a running node (the client finds the rest)."""
        node = next((n for n in self.nodes if n.running), self.nodes[0])
        return f"redis+cluster://{_HOST}:{node.port}"

    def cli(self, node: RedisServer, *args: str, timeout: float = 10) -> str:
        """Run ``redis-cli`` against one node; its output."""
        exe = shutil.which("redis-cli")
        if exe is None:
            raise ServerError("redis-cli not found on PATH")
        done = subprocess.run(
            [exe, "-h", _HOST, "-p", str(node.port), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode:
            raise ServerError(f"redis-cli {' '.join(args)}: {done.stdout[-1500:]}{done.stderr}")
        return done.stdout

    def start(self) -> None:
        """Start every node, create the cluster and wait until it serves every slot."""
        for node in self.nodes:
            node.start()
        exe = shutil.which("redis-cli")
        if exe is None:
            raise ServerError("redis-cli not found on PATH")
        subprocess.run(
            [
                exe,
                "--cluster",
                "create",
                *(f"{_HOST}:{n.port}" for n in self.nodes),
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        self.wait_healthy()

    def role(self, node: RedisServer) -> str:
        """``master`` or ``slave`` (as ROLE says)."""
        return self.cli(node, "ROLE").split("\n", 1)[0].strip()

    def primaries(self) -> list[RedisServer]:
        """The running nodes that are primaries now."""
        return [n for n in self.nodes if n.running and self.role(n) == "master"]

    def replicas_of(self, primary: RedisServer) -> list[RedisServer]:
        """The running nodes that replicate ``primary`` now."""
        mine = []
        for node in self.nodes:
            if node is primary or not node.running:
                continue
            lines = self.cli(node, "INFO", "replication").splitlines()
            if f"master_port:{primary.port}" in (line.strip() for line in lines):
                mine.append(node)
        return mine

    def wait_healthy(self, timeout: float = 30) -> None:
        """Wait until every running node says ``cluster_state:ok``, every replica is in
        sync with a primary and every node has the same map of the slots."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if all(self._healthy(n) for n in self.nodes if n.running) and self._agreed():
                    return
            except (subprocess.SubprocessError, ServerError):
                pass
            if time.monotonic() > deadline:
                raise ServerError("the Redis Cluster did not become healthy")
            time.sleep(0.1)

    def _agreed(self) -> bool:
        """Whether every node has the same map of the slots (``--cluster check``)."""
        node = next(n for n in self.nodes if n.running)
        out = self.cli(node, "--cluster", "check", f"{_HOST}:{node.port}")
        return "[OK] All nodes agree" in out and "[ERR]" not in out and "[WARNING]" not in out

    def _healthy(self, node: RedisServer) -> bool:
        if "cluster_state:ok" not in self.cli(node, "CLUSTER", "INFO"):
            return False
        info = self.cli(node, "INFO", "replication")
        return "role:master" in info or "master_link_status:up" in info

    def close(self) -> None:
        """Stop every node and remove its directory."""
        for node in self.nodes:
            node.close()

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pg_version(bin_dir: Path) -> int:
    version = bin_dir.parent.name
    return int(version) if version.isdigit() else 0


def _pg_bin(name: str) -> str:
    """Locate a PostgreSQL binary, preferring initdb's directory over PATH."""
    dirs: list[Path] = []
    initdb = shutil.which("initdb")
    if initdb is not None:
        dirs.append(Path(initdb).resolve().parent)
    dirs.extend(sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=_pg_version, reverse=True))
    for d in dirs:
        candidate = d / name
        if os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise ServerError(f"PostgreSQL binary {name!r} not found")
    return found


def _pg_os_user() -> str | None:
    """Unprivileged user to run PostgreSQL as, or None when not root."""
    return _os_user(_PG_USER_CANDIDATES)


def _os_user(candidates: Sequence[str]) -> str | None:
    """The first of ``candidates`` that exists (the last one is created if none does),
    to run a server as when we are root; None when we are not root."""
    if os.geteuid() != 0:
        return None
    for name in candidates:
        try:
            pwd.getpwnam(name)
        except KeyError:
            continue
        return name
    name = candidates[-1]
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        check=True,
        capture_output=True,
    )
    return name


class PostgresServer(_Server):
    """A throwaway PostgreSQL cluster on 127.0.0.1 with trust auth.

    Superuser and database are both ``retrysafe``. When run as root the
    cluster runs as an unprivileged OS user (``postgres`` or ``retrysafe-pg``).
    """

    user = "retrysafe"
    database = "retrysafe"

    def __init__(self, port: int | None = None) -> None:
        super().__init__(port)
        self._base: Path | None = None
        self._os_user: str | None = None
        self._has_cluster = False
        self._has_database = False
        self._started = False

    @property
    def url(self) -> str:
        """Connection URL (libpq format)."""
        return f"postgresql://{self.user}@{_HOST}:{self._port}/{self.database}"

    @property
    def os_user(self) -> str | None:
        """OS user the server runs as when started by root, else None."""
        return self._os_user

    @property
    def log_path(self) -> Path | None:
        """Path of the server log, once created."""
        return None if self._base is None else self._base / "postgres.log"

    @property
    def running(self) -> bool:
        """Whether the postmaster process is alive."""
        if not self._started or self._base is None:
            return False
        try:
            pid = int((self._base / "data" / "postmaster.pid").read_text().split()[0])
            os.kill(pid, 0)
        except (OSError, ValueError, IndexError):
            return False
        return True

    def _run(self, *args: str, timeout: float = 120.0) -> None:
        assert self._base is not None
        cmd = list(args)
        if self._os_user is not None:
            cmd = ["runuser", "-u", self._os_user, "--", *cmd]
        proc = subprocess.run(
            cmd,
            cwd=self._base,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if proc.returncode != 0:
            log_path = self._base / "postgres.log"
            raise ServerError(
                f"{' '.join(cmd)} failed with exit code {proc.returncode}:\n"
                f"{proc.stdout}{proc.stderr}\nserver log tail:\n{_log_tail(log_path)}"
            )

    def _init_cluster(self) -> None:
        self._os_user = _pg_os_user()
        # mkdtemp gives 0700; the unprivileged user must own and traverse it.
        base = Path(tempfile.mkdtemp(prefix="retrysafe-pg-", dir="/tmp"))
        self._base = base
        base.chmod(0o755)
        (base / "sock").mkdir()
        if self._os_user is not None:
            pw = pwd.getpwnam(self._os_user)
            for p in (base, base / "sock"):
                os.chown(p, pw.pw_uid, pw.pw_gid)
        self._run(
            _pg_bin("initdb"),
            "-D",
            str(base / "data"),
            "-U",
            self.user,
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-locale",
            "--no-sync",
        )
        self._has_cluster = True

    def _pg_ctl_start(self) -> None:
        assert self._base is not None
        opts = (
            f"-p {self._port} -k {self._base / 'sock'} -c listen_addresses={_HOST}"
            " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
            " -c max_connections=200"
        )
        self._run(
            _pg_bin("pg_ctl"),
            "-D",
            str(self._base / "data"),
            "-o",
            opts,
            "-l",
            str(self._base / "postgres.log"),
            "-w",
            "-t",
            "60",
            "start",
        )

    def start(self) -> None:
        """Start the server, creating the cluster and database on first use."""
        if self.running:
            return
        _track(self)
        if not self._has_cluster:
            self._init_cluster()
        # An automatically chosen port may be taken between free_port() and
        # bind(); retry with a fresh one, but only before the first success.
        attempts = 3 if self._auto_port else 1
        for attempt in range(attempts):
            try:
                self._pg_ctl_start()
                break
            except ServerError:
                if attempt == attempts - 1:
                    raise
                self._port = free_port()
        self._auto_port = False
        self._started = True
        if not self._has_database:
            self._run(
                _pg_bin("createdb"),
                "-h",
                _HOST,
                "-p",
                str(self._port),
                "-U",
                self.user,
                self.database,
            )
            self._has_database = True

    def stop(self) -> None:
        """Stop the server (fast shutdown); keep the cluster for a restart."""
        if self._base is None or not self.running:
            self._started = False
            return
        data = str(self._base / "data")
        try:
            self._run(_pg_bin("pg_ctl"), "-D", data, "-m", "fast", "-w", "-t", "30", "stop")
        except (ServerError, subprocess.TimeoutExpired):
            self._run(_pg_bin("pg_ctl"), "-D", data, "-m", "immediate", "-w", "stop")
        self._started = False

    def close(self) -> None:
        """Stop the server and remove its temporary directory."""
        try:
            self.stop()
        finally:
            if self._base is not None:
                shutil.rmtree(self._base, ignore_errors=True)
                self._base = None
            self._has_cluster = self._has_database = False
            _untrack(self)


def _mysql_bin(name: str) -> str:
    """Locate a MariaDB binary on PATH or in /usr/sbin (where Debian puts mariadbd)."""
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/local/sbin")
    if found is None:
        raise ServerError(f"MariaDB binary {name!r} not found (apt-get install mariadb-server)")
    return found


class MySQLServer(_Server):
    """A throwaway MariaDB server (Debian's ``mariadbd``) on 127.0.0.1.

    Its data directory and socket live in a fresh directory under /tmp; no system
    configuration file is read (``--no-defaults``). When run as root the server runs
    as an unprivileged OS user (``mysql`` or ``retrysafe-pg``). User ``retrysafe``
    (no password, every privilege) and database ``retrysafe`` are created at first
    start; ``root`` has no password either.

    ``isolation`` is the server's default transaction isolation (``READ-COMMITTED``,
    ...; None: InnoDB's REPEATABLE READ). ``durable=False`` writes the redo log to the
    OS at each commit and fsyncs it once a second (a SIGKILL of the server loses
    nothing; a crash of the machine could), and turns the doublewrite buffer off;
    ``durable=True`` keeps InnoDB's defaults (an fsync per commit). ``extra`` adds
    more ``mariadbd`` options.
    """

    user = "retrysafe"
    database = "retrysafe"

    def __init__(
        self,
        port: int | None = None,
        *,
        isolation: str | None = None,
        durable: bool = False,
        extra: Sequence[str] = (),
    ) -> None:
        super().__init__(port)
        self.isolation = None if isolation is None else isolation.upper().replace(" ", "-")
        self.durable = durable
        self.extra = list(extra)
        self._base: Path | None = None
        self._os_user: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._has_database = False

    @property
    def url(self) -> str:
        """Connection URL of user ``retrysafe`` on database ``retrysafe``."""
        return f"mysql://{self.user}@{_HOST}:{self._port}/{self.database}"

    @property
    def os_user(self) -> str | None:
        """OS user the server runs as when started by root, else None."""
        return self._os_user

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """Process id of the running server, else None."""
        return self._proc.pid if self.running and self._proc is not None else None

    @property
    def log_path(self) -> Path | None:
        """Path of the server's log (its stderr), once created."""
        return None if self._base is None else self._base / "mariadb.log"

    def sql(self, statements: str, *, timeout: float = 30.0) -> str:
        """Run ``statements`` as ``root`` over TCP with the ``mariadb`` client; its
        output (tab-separated, no column names)."""
        done = self._client(statements, timeout)
        if done.returncode:
            raise ServerError(
                f"mariadb client on port {self._port} failed with exit code "
                f"{done.returncode}: {done.stderr.strip()}"
            )
        return done.stdout

    def _client(self, statements: str, timeout: float) -> subprocess.CompletedProcess[str]:
        cmd = [
            _mysql_bin("mariadb"),
            "--no-defaults",
            "--protocol=TCP",
            f"--host={_HOST}",
            f"--port={self._port}",
            "--user=root",
            "--connect-timeout=5",
            "--batch",
            "--skip-column-names",
            "--execute",
            statements,
        ]
        return subprocess.run(
            cmd,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def _init_datadir(self) -> None:
        self._os_user = _os_user(_MYSQL_USER_CANDIDATES)
        # mkdtemp gives 0700; the unprivileged user must own and traverse it.
        base = Path(tempfile.mkdtemp(prefix="retrysafe-mysql-", dir="/tmp"))
        self._base = base
        base.chmod(0o755)
        (base / "data").mkdir()
        (base / "tmp").mkdir()
        as_user: list[str] = []
        if self._os_user is not None:
            pw = pwd.getpwnam(self._os_user)
            for p in (base, base / "data", base / "tmp"):
                os.chown(p, pw.pw_uid, pw.pw_gid)
            as_user = [f"--user={self._os_user}"]
        mariadbd = Path(_mysql_bin("mariadbd")).resolve()
        cmd = [
            _mysql_bin("mariadb-install-db"),
            "--no-defaults",
            f"--basedir={mariadbd.parent.parent}",
            f"--datadir={base / 'data'}",
            "--auth-root-authentication-method=normal",
            "--skip-test-db",
            "--skip-name-resolve",
            # Its bootstrap server's temporary tables go in the private dir, not in a
            # shared /tmp (it failed there twice on a busy machine).
            f"--tmpdir={base / 'tmp'}",
            *as_user,
        ]
        done = subprocess.run(
            cmd,
            cwd=base,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if done.returncode:
            raise ServerError(
                f"{' '.join(cmd)} failed with exit code {done.returncode}:\n"
                f"{done.stdout[-3000:]}{done.stderr[-3000:]}"
            )

    def _argv(self) -> list[str]:
        assert self._base is not None
        argv = [
            _mysql_bin("mariadbd"),
            "--no-defaults",  # first: no /etc/mysql, no ~/.my.cnf
            f"--datadir={self._base / 'data'}",
            f"--tmpdir={self._base / 'tmp'}",
            f"--socket={self._base / 'mysqld.sock'}",
            f"--pid-file={self._base / 'mysqld.pid'}",
            f"--port={self._port}",
            f"--bind-address={_HOST}",
            "--skip-name-resolve",
            "--skip-log-bin",
            "--max-connections=500",  # the race tests open many
            "--innodb-buffer-pool-size=64M",
            "--innodb-log-buffer-size=8M",
            # What Debian's own configuration sets (the compiled default is latin1).
            "--character-set-server=utf8mb4",
            "--collation-server=utf8mb4_general_ci",
        ]
        if not self.durable:
            argv += ["--innodb-flush-log-at-trx-commit=2", "--innodb-doublewrite=0"]
        if self.isolation is not None:
            argv.append(f"--transaction-isolation={self.isolation}")
        if self._os_user is not None:
            argv.append(f"--user={self._os_user}")  # mariadbd refuses to run as root
        return [*argv, *self.extra]

    def start(self) -> None:
        """Start the server and wait until root can connect; create the data directory,
        user and database on first use. A restart keeps the port and the data."""
        if self.running:
            return
        _track(self)
        if self._base is None:
            self._init_datadir()
        # An automatically chosen port may be taken between free_port() and
        # bind(); retry with a fresh one, but only before the first success.
        attempts = 3 if self._auto_port else 1
        for attempt in range(attempts):
            try:
                self._spawn()
                break
            except ServerError:
                if attempt == attempts - 1:
                    raise
                self._port = free_port()
        self._auto_port = False
        if not self._has_database:
            self.sql(
                f"CREATE USER IF NOT EXISTS '{self.user}'@'{_HOST}';"
                f" GRANT ALL PRIVILEGES ON *.* TO '{self.user}'@'{_HOST}' WITH GRANT OPTION;"
                f" CREATE DATABASE IF NOT EXISTS `{self.database}`;"
            )
            self._has_database = True

    def _spawn(self) -> None:
        assert self._base is not None
        log_path = self._base / "mariadb.log"
        with open(log_path, "ab") as log:
            self._proc = subprocess.Popen(
                self._argv(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self._base,
            )
        deadline = time.monotonic() + _MYSQL_START_TIMEOUT
        error = ""
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                error = f"mariadbd exited with code {self._proc.returncode}"
                break
            try:
                done = self._client("SELECT 1", timeout=10)
            except subprocess.TimeoutExpired:
                continue
            if done.returncode == 0:
                return
            error = done.stderr.strip()
            time.sleep(0.05)
        else:
            error = f"no connection within {_MYSQL_START_TIMEOUT:.0f}s ({error})"
        self._terminate()
        raise ServerError(
            f"mariadbd on port {self._port} did not start: {error}; log tail:\n"
            f"{_log_tail(log_path)}"
        )

    def _terminate(self) -> None:
        proc, self._proc = self._proc, None
        _end(proc, _MYSQL_STOP_TIMEOUT)

    def stop(self) -> None:
        """Stop the server (SIGTERM: a clean shutdown; SIGKILL after 60 s); keep its data."""
        self._terminate()

    def kill(self) -> None:
        """SIGKILL the server, as a crash would; :meth:`start` recovers its data (InnoDB
        crash recovery) on the same port."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        """Stop the server and remove its temporary directory."""
        try:
            self._terminate()
        finally:
            if self._base is not None:
                shutil.rmtree(self._base, ignore_errors=True)
                self._base = None
            self._has_database = False
            _untrack(self)


if __name__ == "__main__":
    import psycopg
    import redis

    def _check(rs: RedisServer, pg: PostgresServer, value: str) -> None:
        client = redis.Redis.from_url(rs.url)
        client.set("smoke", value)
        assert client.get("smoke") == value.encode()
        client.close()
        with psycopg.connect(pg.url) as conn:
            row = conn.execute("SELECT current_user, current_database(), %s", (value,)).fetchone()
            assert row == ("retrysafe", "retrysafe", value), row

    t0 = time.monotonic()
    with RedisServer() as rs:
        print(f"redis    {rs.url} up in {time.monotonic() - t0:.2f}s")
        t0 = time.monotonic()
        with PostgresServer() as pg:
            print(f"postgres {pg.url} up in {time.monotonic() - t0:.2f}s (os user {pg.os_user})")
            _check(rs, pg, "one")
            t0 = time.monotonic()
            rs.restart()
            print(f"redis restarted in {time.monotonic() - t0:.2f}s, running={rs.running}")
            t0 = time.monotonic()
            pg.restart()
            print(f"postgres restarted in {time.monotonic() - t0:.2f}s, running={pg.running}")
            _check(rs, pg, "two")
            ports = (rs.port, pg.port)
        assert not pg.running
    assert not rs.running
    print(f"ok: ports {ports} stopped")
