"""Run an HTTP server as a child process group and never leave it behind.

Generic on purpose: the SGLang launcher and the local engine server both use it. A server is
started in its own session (so its workers form one process group we can signal at once),
with stdout/stderr in a log file; `wait_healthy` polls `GET /health` with a deadline and fails
at once, with the log tail, when the process dies during start-up. Teardown kills the whole
group on normal exit, on error, on Ctrl-C (the `with` block) and when the parent is killed:
the child is started through a tiny wrapper (`python -m workbench.serving.process --parent PID
-- CMD`) that asks the kernel for a signal when the parent dies (prctl PR_SET_PDEATHSIG) and
also polls the parent pid, and then tears down the group it leads. A running server can be
attached by URL instead; attaching never kills anything.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from workbench.errors import WorkbenchError

LOOPBACK = "127.0.0.1"
PR_SET_PDEATHSIG = 1


class ServerError(WorkbenchError):
    """A server could not be started, never became healthy, or died."""


def free_port(host: str = LOOPBACK) -> int:
    """A port the kernel says is free on `host` now (another process may take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
        return False


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return "(no log written)"
    return "\n".join(text.splitlines()[-lines:])


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """GET `url`; returns (status, body). Connection errors raise OSError."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def is_healthy(url: str, timeout: float = 5.0) -> bool:
    try:
        status, _ = http_get(url.rstrip("/") + "/health", timeout=timeout)
    except OSError:
        return False
    return status == 200


@dataclass
class Server:
    """A server at `url`: launched by us (`proc` set, we own its process group) or attached."""

    url: str
    log_path: Path | None = None
    proc: subprocess.Popen | None = None
    argv: list[str] = field(default_factory=list)
    start_s: float | None = None  # seconds from launch until /health answered 200
    launched_at: float | None = None  # time.monotonic() at launch

    @property
    def pgid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        if self.proc is None:
            return is_healthy(self.url)
        return self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines) if self.log_path else "(attached: no log)"

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the whole process group, SIGKILL what is left after `grace_s`. Idempotent."""
        if self.proc is None:
            return
        kill_group(self.proc.pid, grace_s)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=1.0)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def group_members(pgid: int, exclude: int | None = None) -> list[int]:
    """Live pids in process group `pgid` (zombies excluded: they run nothing), from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == exclude:
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # after "pid (comm) "
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry))
    return out


def kill_group(pgid: int, grace_s: float = 10.0) -> None:
    """SIGTERM group `pgid`, wait up to `grace_s` for it to go, then SIGKILL what is left."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not group_members(pgid):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def launch(
    argv: list[str],
    log_path: Path,
    url: str,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> Server:
    """Start `argv` in a new process group behind the parent-death wrapper; do not wait.

    `url` is where the server will answer (the caller chose host and port and put them in
    `argv`). `env` is the full child environment (default: ours).
    """
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    wrapper = [sys.executable, "-m", "workbench.serving.process", "--parent", str(os.getpid())]
    log = open(log_path, "ab")  # noqa: SIM115 - handed to the child; closed below
    try:
        proc = subprocess.Popen(
            [*wrapper, "--", *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=None if env is None else dict(env),
            cwd=cwd,
            start_new_session=True,
        )
    except OSError as e:
        raise ServerError(f"could not start {argv[0]!r}: {e}") from e
    finally:
        log.close()
    return Server(url, log_path, proc, list(argv), launched_at=time.monotonic())


def wait_healthy(server: Server, deadline_s: float, poll_s: float = 0.5) -> float:
    """Poll /health until 200; returns seconds waited. Dies or times out → ServerError, torn down."""
    t0 = time.monotonic()
    while True:
        if server.proc is not None and server.proc.poll() is not None:
            code = server.proc.returncode
            server.stop()
            raise ServerError(
                f"server exited with code {code} during start-up; log {server.log_path}:\n"
                f"{server.log_tail()}"
            )
        # SGLang's /health runs a one-token generation: 1.5 s on a slow CPU day, so a 1 s
        # read timeout never saw its 200 (a plugin server 'unhealthy' for 400 s while serving)
        if is_healthy(server.url, timeout=5.0):
            now = time.monotonic()
            server.start_s = now - (server.launched_at or t0)
            return now - t0
        if time.monotonic() - t0 > deadline_s:
            server.stop()
            raise ServerError(
                f"server at {server.url} not healthy after {deadline_s:.0f} s (torn down); "
                f"raise the deadline or read the log {server.log_path}:\n{server.log_tail()}"
            )
        time.sleep(poll_s)


def start(
    argv: list[str],
    log_path: Path,
    url: str,
    deadline_s: float = 300.0,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> Server:
    """`launch` + `wait_healthy`; on any failure (Ctrl-C included) the group is torn down."""
    server = launch(argv, log_path, url, env=env, cwd=cwd)
    try:
        wait_healthy(server, deadline_s)
    except BaseException:
        server.stop()
        raise
    return server


def attach(url: str, timeout_s: float = 10.0) -> Server:
    """A running server at `url` (not ours: `stop` leaves it alone). Unhealthy → ServerError."""
    url = url.rstrip("/")
    deadline = time.monotonic() + timeout_s
    while not is_healthy(url):
        if time.monotonic() > deadline:
            raise ServerError(
                f"no healthy server at {url} (GET /health did not answer 200 within "
                f"{timeout_s:.0f} s); start one or fix the URL"
            )
        time.sleep(0.5)
    return Server(url=url)


# --- the wrapper: runs as the process-group leader between us and the server -------------


def _set_pdeathsig(sig: int) -> None:
    """Ask Linux to send `sig` to this process when its parent dies (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def _wrapper_main(parent: int, cmd: list[str], poll_s: float = 0.5) -> int:
    """Run `cmd` as a child; exit with it; when `parent` dies or we are signalled, kill the group.

    We lead the process group (the launcher used start_new_session), so killpg(0) reaches
    the server and every worker it spawned that stayed in the group.
    """
    stop = {"sig": 0}

    def on_signal(signum: int, _frame: object) -> None:
        stop["sig"] = signum

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on_signal)
    # PDEATHSIG fires when the *thread* that forked us exits, which may not be the parent
    # process dying: it gets its own signal and is checked against the parent pid below.
    signal.signal(signal.SIGUSR1, lambda *_: None)
    _set_pdeathsig(signal.SIGUSR1)
    if os.getppid() != parent:  # the parent died before prctl took effect
        return 1
    child = subprocess.Popen(cmd)
    while True:
        try:
            code = child.wait(timeout=poll_s)
            _kill_own_group(grace_s=5.0)
            return code
        except subprocess.TimeoutExpired:
            pass
        if stop["sig"] or os.getppid() != parent:
            _kill_own_group(grace_s=5.0, child=child)
            return 128 + (stop["sig"] or signal.SIGKILL)


def _kill_own_group(grace_s: float, child: subprocess.Popen | None = None) -> None:
    """TERM every other member of our group, wait, then KILL them (we exit right after)."""
    me, pgid = os.getpid(), os.getpgid(0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and group_members(pgid, exclude=me):
        if child is not None:
            child.poll()  # reap the direct child so it does not linger as a zombie
        time.sleep(0.1)
    for pid in group_members(pgid, exclude=me):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if child is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=1.0)


def main(args: list[str]) -> int:
    if len(args) < 4 or args[0] != "--parent" or args[2] != "--":
        print("usage: python -m workbench.serving.process --parent PID -- CMD...", file=sys.stderr)
        return 2
    return _wrapper_main(int(args[1]), args[3:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
