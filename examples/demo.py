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
        sent, _ = sender.communicate(timeout=TIMEOUT)
        out, _ = receiver.communicate(timeout=TIMEOUT)
        summary = json.loads(out.strip().splitlines()[-1])
        print(f"sender:   {sent.strip()}")
        print(
            f"summary:  {summary['requests']} requests, {summary['chunks']}/{summary['chunks_expected']} chunks "
            f"({summary['bad_chunks']} bad), {summary['blocks']} blocks ({summary['bad_blocks']} bad), "
            f"{summary['bytes'] / 1e6:.1f} MB; chunks {summary['chunks_per_s']}/s {summary['chunk_MBps']} MB/s, "
            f"latency (all chunks queued at once) p50 {summary['latency_p50_us']} us "
            f"p99 {summary['latency_p99_us']} us; "
            f"blocks {summary['block_GBps']} GB/s -> {'OK' if summary['ok'] else 'FAILED'}"
        )
        return 0 if summary["ok"] and sender.returncode == 0 and receiver.returncode == 0 else 1
    finally:
        for proc in (sender, receiver):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


if __name__ == "__main__":
    sys.exit(main())
