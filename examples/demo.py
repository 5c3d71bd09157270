"""Run the example pair as two processes on loopback and print one summary.

    python examples/demo.py

Starts ``receiver.py``, passes the address it prints to ``sender.py``, waits for both (with a
timeout), prints the receiver's verdict and exits 0 only if every chunk and block verified.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT = 120


def main() -> int:
    env = {**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")}
    receiver = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "receiver.py")], stdout=subprocess.PIPE, text=True, env=env
    )
    sender = None
    try:
        assert receiver.stdout is not None
        address = json.loads(receiver.stdout.readline())["address"]
        print(f"receiver listening on {address}", flush=True)
        sender = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "sender.py"), address], stdout=subprocess.PIPE, text=True, env=env
        )
        sent_line, _ = sender.communicate(timeout=TIMEOUT)
        out, _ = receiver.communicate(timeout=TIMEOUT)
        got, sent = json.loads(out.strip().splitlines()[-1]), json.loads(sent_line)
        bad_chunks = got["chunks_expected"] - got["ok_chunks"]
        print(f"sender:   {sent_line.strip()}")
        print(
            f"summary:  {sent['requests']} requests, {got['ok_chunks']}/{got['chunks_expected']} chunks "
            f"({bad_chunks} bad), {got['blocks']} blocks ({got['bad_blocks']} bad), "
            f"{(got['bytes'] + sent['blocks'] * sent['block_bytes']) / 1e6:.1f} MB; "
            f"chunks {sent['chunks_per_s']}/s {sent['chunk_MBps']} MB/s, "
            f"ack latency (all requests at once) p50 {sent['latency_p50_us']} us p99 {sent['latency_p99_us']} us; "
            f"blocks {sent['block_GBps']} GB/s -> {'OK' if got['ok'] else 'FAILED'}"
        )
        return 0 if got["ok"] and sender.returncode == 0 and receiver.returncode == 0 else 1
    finally:
        for proc in (sender, receiver):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


if __name__ == "__main__":
    sys.exit(main())
