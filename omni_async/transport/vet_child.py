"""The address-vetting processes (see :mod:`omni_async.transport.vetting`).

``python -m omni_async.transport.vet_child UCX_TLS UCX_NET_DEVICES`` starts a *zygote*: it
imports ucxx once (the slow part, about a second), answers one byte on stdout when ready, then
reads socket descriptors from its stdin (a Unix socket, ``SCM_RIGHTS``).  For each one it forks a
*server* that owns that socket: the server creates its UCX context and worker (tens of
milliseconds), answers ``\\x01``, then, for every request it reads (:data:`REQUEST`: the
lengths of a worker address and of its packed remote keys, then both; the keys each
length-prefixed), creates (and drops) a UCX endpoint from the address, unpacks (and destroys)
each remote key on it (:mod:`.rma`), and answers ``\\x01`` (usable) or ``\\x00`` (UCX
refused it).  If UCX aborts on an address, only that server dies, which is the answer the parent
was looking for; the parent asks the zygote for a new server, without paying the import again.
A server hung inside UCX kills itself (``SIGALRM``) after :data:`HANG_LIMIT` seconds.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import sys
from typing import Final

LENGTH: Final = struct.Struct("<I")
REQUEST: Final = struct.Struct("<II")
"""A check's lengths: the worker address, then its packed remote keys (0: none)."""
OK: Final = b"\x01"
BAD: Final = b"\x00"
HANG_LIMIT: Final = 10
"""Seconds one endpoint creation may take before the server ends itself."""


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return b""
        data += chunk
    return data


def serve(sock: socket.socket, tls: str, net_devices: str) -> None:
    """Vet the addresses sent on ``sock`` until it is closed."""
    import ucxx._lib.libucxx as ucx_api

    from .lane import new_context

    context = new_context(tls, net_devices)
    worker = ucx_api.UCXWorker(context, enable_delayed_submission=False, enable_python_future=False)
    sock.sendall(OK)
    while header := _read_exactly(sock, REQUEST.size):
        address_length, keys_length = REQUEST.unpack(header)
        address = _read_exactly(sock, address_length)
        keys = _read_exactly(sock, keys_length)
        signal.alarm(HANG_LIMIT)
        try:
            if keys:
                _unpack_keys(worker, address, keys)
            else:
                remote = ucx_api.UCXAddress.create_from_buffer(address)
                endpoint = worker.create_endpoint_from_worker_address(remote, False)
                endpoint.close()  # non-blocking: never wait on the peer from here
            verdict = OK
        except Exception:
            verdict = BAD
        signal.alarm(0)
        sock.sendall(verdict)


def _unpack_keys(worker: object, address: bytes, keys: bytes) -> None:
    """Unpack (and destroy) each length-prefixed remote key of ``keys`` on an endpoint to
    ``address`` (vetted before), as a lane does; raise if UCX refuses one."""
    from . import iov, rma

    endpoint = iov.connect(worker, address)
    try:
        offset = 0
        while offset < len(keys):
            (length,) = LENGTH.unpack_from(keys, offset)
            offset += LENGTH.size
            if length == 0 or offset + length > len(keys):
                raise ValueError("malformed key list")
            rma.destroy_key(rma.unpack_key(endpoint, keys[offset : offset + length]))
            offset += length
    finally:
        closing = iov.close(endpoint)  # never waited on: the worker is not progressed
        if closing:
            iov.free(closing)


def main(tls: str, net_devices: str) -> None:
    # UCX may print to fd 1: send it to stderr; the ready byte goes to a private copy of stdout.
    ready = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    from .lane import load_ucxx

    load_ucxx()  # the slow import, paid once for every server

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # servers are reaped by the kernel
    requests = socket.socket(fileno=os.dup(0))
    ready.write(OK)
    ready.close()
    while True:
        try:
            _, fds, _, _ = socket.recv_fds(requests, 1, 1)
        except OSError:
            return
        if not fds:  # the parent closed its end
            return
        if os.fork() == 0:
            requests.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                serve(socket.socket(fileno=fds[0]), tls, net_devices)
            finally:
                os._exit(0)
        os.close(fds[0])


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
