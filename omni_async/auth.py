"""Control-plane authentication with ZeroMQ CURVE: key pairs and an allow-list gate.

With CURVE on, every control connection is encrypted and both ends are authenticated: the
dialler pins the listener's public key (carried in the address as ``tcp://host:port?key=KEY``)
and the listener admits only clients whose public key is on its allow-list.  The check runs in
ZeroMQ's handshake (ZAP, RFC 27), before any omni_async message is read, so a stranger learns
nothing about the region.  Keys are Z85 text (40 characters); ``omni-async keygen`` makes them.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.utils import z85

from .config import check_key

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_KEY_SEPARATOR = "?key="


def generate_keypair() -> tuple[str, str]:
    """A new ``(public_key, secret_key)`` pair, Z85 text."""
    public, secret = zmq.curve_keypair()
    return public.decode("ascii"), secret.decode("ascii")


def public_key(secret_key: str) -> str:
    """The public key that belongs to ``secret_key``."""
    check_key(secret_key, "curve_secret_key")
    return zmq.curve_public(secret_key.encode("ascii")).decode("ascii")


def split_address(address: str) -> tuple[str, str | None]:
    """``"tcp://h:p?key=K"`` → ``("tcp://h:p", "K")``; no key → ``(address, None)``."""
    endpoint, sep, key = address.partition(_KEY_SEPARATOR)
    return endpoint, (key if sep else None)


def join_address(endpoint: str, key: str | None) -> str:
    return f"{endpoint}{_KEY_SEPARATOR}{key}" if key else endpoint


@dataclass
class CurveGate:
    """Answers ZeroMQ's authentication requests for one context: allow-listed keys only.

    Owned by the control plane: ``start()`` binds the ZAP socket and starts its task,
    ``await close()`` stops both.
    """

    context: zmq.asyncio.Context
    allowed: frozenset[str]
    refused: int = 0
    _socket: zmq.asyncio.Socket | None = None
    _task: asyncio.Task[None] | None = None
    _logged: set[str] = field(default_factory=set)

    def start(self) -> None:
        self._socket = self.context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(ZAP_ENDPOINT)
        self._task = asyncio.get_running_loop().create_task(self._serve(self._socket), name="omni-control-zap")

    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            await sock.send_multipart(self._answer(frames))

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        """One ZAP reply (RFC 27): 200 for an allow-listed CURVE key, 400 otherwise."""
        version = frames[0] if frames else b"1.0"
        request_id = frames[1] if len(frames) > 1 else b""
        mechanism = frames[5] if len(frames) > 5 else b""
        address = frames[3].decode("utf-8", "replace") if len(frames) > 3 else "?"
        if mechanism == b"CURVE" and len(frames) > 6 and len(frames[6]) == 32:
            key = z85.encode(frames[6]).decode("ascii")
            if key in self.allowed:
                return [version, request_id, b"200", b"OK", key.encode("ascii"), b""]
        else:
            key = f"<{mechanism.decode('ascii', 'replace') or 'no'} mechanism>"
        self.refused += 1
        if key not in self._logged and len(self._logged) < 4096:
            self._logged.add(key)
            log.warning("refused control connection from %s: key %s is not allowed", address, key)
        return [version, request_id, b"400", b"not allowed", b"", b""]

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._socket is not None:
            self._socket.close(linger=0)
