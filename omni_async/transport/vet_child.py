"""The address-vetting child process (see :mod:`omni_async.transport.vetting`).

``python -m omni_async.transport.vet_child UCX_TLS UCX_NET_DEVICES``: answers one byte on stdout when ready,
then, for every length-prefixed worker address read on stdin, creates (and drops) a UCX
endpoint from it and answers ``\\x01`` (usable) or ``\\x00`` (UCX refused it).  If UCX aborts
on the address, the process dies, which is the answer the parent was looking for.
"""

from __future__ import annotations

import os
import struct
import sys


def main(tls: str, net_devices: str) -> None:
    # Replies go to a private copy of stdout; UCX may print to fd 1 and must not corrupt them.
    replies = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    import ucxx._lib.libucxx as ucx_api

    from .lane import new_context

    context = new_context(tls, net_devices)
    worker = ucx_api.UCXWorker(context, enable_delayed_submission=False, enable_python_future=False)
    length = struct.Struct("<I")
    requests = sys.stdin.buffer
    replies.write(b"\x01")
    while header := requests.read(length.size):
        address = requests.read(length.unpack(header)[0])
        try:
            remote = ucx_api.UCXAddress.create_from_buffer(address)
            endpoint = worker.create_endpoint_from_worker_address(remote, False)
            endpoint.close()  # non-blocking: never wait on the peer from here
            verdict = b"\x01"
        except Exception:
            verdict = b"\x00"
        replies.write(verdict)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
