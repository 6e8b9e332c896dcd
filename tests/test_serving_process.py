"""workbench.serving.process with a cheap dummy HTTP server (not SGLang): start, health,
death during start-up, deadline, attach, and no server left behind after stop, Ctrl-C or a
SIGKILLed parent."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from workbench.serving import process as sp

# A server that answers /health after `delay` seconds and keeps a grandchild in its group
# (like SGLang's scheduler processes), so teardown must reach the whole group.
DUMMY = textwrap.dedent(
    """
    import http.server, subprocess, sys, time
    port, delay, mode = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    if mode == "die":
        print("boom: the dummy refuses to start", flush=True)
        sys.exit(3)
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    t0 = time.monotonic()

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.path == "/health" and time.monotonic() - t0 >= delay and mode != "sick"
            self.send_response(200 if ok else 503)
            self.end_headers()
            self.wfile.write(b"ok" if ok else b"starting")

        def log_message(self, *a):
            pass

    print("dummy up", flush=True)
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


@pytest.fixture
def dummy(tmp_path: Path) -> Path:
    p = tmp_path / "dummy_server.py"
    p.write_text(DUMMY)
    return p


def _argv(dummy: Path, port: int, delay: float = 0.3, mode: str = "ok") -> list[str]:
    return [sys.executable, str(dummy), str(port), str(delay), mode]


def _wait_gone(pgid: int, within_s: float) -> float:
    t0 = time.monotonic()
    while sp.group_members(pgid):
        if time.monotonic() - t0 > within_s:
            raise AssertionError(f"group {pgid} still has {sp.group_members(pgid)}")
        time.sleep(0.1)
    return time.monotonic() - t0


def test_free_port_is_bindable_and_port_in_use_detects_a_listener():
    port = sp.free_port()
    assert not sp.port_in_use(sp.LOOPBACK, port)
    with socket.socket() as s:
        s.bind((sp.LOOPBACK, port))
        s.listen()
        assert sp.port_in_use(sp.LOOPBACK, port)


def test_start_waits_for_health_and_stop_tears_down_the_whole_group(dummy, tmp_path):
    port = sp.free_port()
    url = f"http://{sp.LOOPBACK}:{port}"
    with sp.start(_argv(dummy, port, delay=1.0), tmp_path / "s.log", url, deadline_s=30) as srv:
        assert srv.start_s is not None and srv.start_s >= 0.9
        assert sp.is_healthy(url)
        pgid = srv.pgid
        assert len(sp.group_members(pgid)) >= 3  # wrapper, server, grandchild
        # Attaching to it by URL works and stopping the attached handle kills nothing.
        att = sp.attach(url)
        att.stop()
        assert sp.is_healthy(url)
    _wait_gone(pgid, 10)
    assert not sp.is_healthy(url)
    assert "dummy up" in (tmp_path / "s.log").read_text()


def test_death_during_startup_fails_at_once_with_the_log_tail(dummy, tmp_path):
    port = sp.free_port()
    t0 = time.monotonic()
    with pytest.raises(sp.ServerError, match="(?s)code 3.*boom: the dummy refuses"):
        sp.start(_argv(dummy, port, mode="die"), tmp_path / "d.log", f"http://127.0.0.1:{port}")
    assert time.monotonic() - t0 < 10


def test_never_healthy_hits_the_deadline_and_is_torn_down(dummy, tmp_path):
    port = sp.free_port()
    srv = sp.launch(_argv(dummy, port, mode="sick"), tmp_path / "n.log", f"http://127.0.0.1:{port}")
    with pytest.raises(sp.ServerError, match="not healthy after 2 s"):
        sp.wait_healthy(srv, deadline_s=2.0)
    _wait_gone(srv.pgid, 10)


def test_attach_to_nothing_is_a_clear_error():
    port = sp.free_port()
    with pytest.raises(sp.ServerError, match="no healthy server"):
        sp.attach(f"http://127.0.0.1:{port}", timeout_s=0.5)


PARENT = textwrap.dedent(
    """
    import signal, sys, time
    from pathlib import Path
    from workbench.serving import process as sp
    # Ctrl-C as in a terminal: a job a non-interactive shell put in the background inherits
    # SIGINT ignored, and Python then never raises KeyboardInterrupt
    signal.signal(signal.SIGINT, signal.default_int_handler)
    dummy, port, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    argv = [sys.executable, dummy, str(port), "0.2", "ok"]
    try:
        with sp.start(argv, Path(log), f"http://127.0.0.1:{port}", deadline_s=30) as srv:
            print(srv.pgid, flush=True)
            time.sleep(600)
    except KeyboardInterrupt:  # Ctrl-C: the with block has torn the server down
        sys.exit(130)
    """
)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_a_killed_or_interrupted_parent_leaves_no_server_behind(dummy, tmp_path, sig):
    port = sp.free_port()
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(dummy), str(port), str(tmp_path / "p.log")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pgid = int(parent.stdout.readline())
        assert sp.is_healthy(f"http://127.0.0.1:{port}")
        members = sp.group_members(pgid)
        assert len(members) >= 3
        os.kill(parent.pid, sig)
        parent.wait(timeout=30)
        took = _wait_gone(pgid, 8)
        assert took < 8
        assert not sp.is_healthy(f"http://127.0.0.1:{port}")
    finally:
        if parent.poll() is None:
            parent.kill()
