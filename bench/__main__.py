"""``python -m bench <command>``: ``blocks`` (block writes vs memcpy and NIXL), ``chunks``
(chunk streams through the adapter vs memcpy), ``layers`` (a region set vs NIXL), ``idle`` (CPU
of an idle connected pair), ``profile`` (per-function cost of one small transfer), ``gc`` (what
the garbage collector costs a chunk stream), ``compare``
(side-by-side tables of saved runs: ``make bench`` leaves each report's JSON in ``bench/out``).

``--json`` prints one JSON object on stdout (the table then goes to stderr).  ``--plot FILE``
(blocks, chunks) also draws the run as grouped bars (:mod:`bench.plot`; needs the ``bench``
extra, checked before the run starts).  The exit status is 0 when the run completed, whether
or not targets were met.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from omni_async.eventloop import run


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    blocks = sub.add_parser("blocks", help="block writes: omni_async vs numpy memcpy vs NIXL")
    blocks.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    blocks.add_argument("--tcp", action="store_true", help="only the UCX_TLS=tcp rows (a_tcp, b_tcp, c_tcp)")
    blocks.add_argument("--iters", type=int, default=None, help="timed iterations per round of b/c (a: 20×)")
    blocks.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5; --quick 1)")
    blocks.add_argument("--quick", action="store_true", help="few iterations, one round: a smoke run")
    blocks.add_argument("--no-nixl", action="store_true", help="skip NIXL (reported as unavailable)")
    blocks.add_argument("--no-compat", action="store_true", help="skip the facade rows compat_a|b|c")
    blocks.add_argument("--nixl-error-handling", default="peer", choices=["peer", "none"],
                        help="NIXL UCX backend ucx_error_handling_mode (default: NIXL's default, peer)")

    chunks = sub.add_parser("chunks", help="chunk streams through the adapter vs numpy memcpy")
    chunks.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    for sub_parser in (blocks, chunks):
        sub_parser.add_argument("--plot", metavar="FILE", help="also draw the results to FILE (.svg, .png, .pdf)")
    chunks.add_argument("--quick", action="store_true", help="few iterations: a smoke run")
    chunks.add_argument("--tcp", action="store_true", help="only the UCX_TLS=tcp rows")
    chunks.add_argument("--no-zmq", action="store_true", help="skip the pyzmq + msgspec baseline")

    layers = sub.add_parser("layers", help="64 scattered blocks × 32 layers (a region set) vs NIXL and memcpy")
    layers.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    layers.add_argument("--quick", action="store_true", help="few iterations: a smoke run")
    layers.add_argument("--no-nixl", action="store_true", help="skip NIXL (reported as unavailable)")
    profile = sub.add_parser("profile", help="per-function cost of one small transfer (cProfile, both sides)")
    profile.add_argument("--kind", choices=["a", "message"], default="a")
    profile.add_argument("--writes", type=int, default=2000)
    profile.add_argument("--top", type=int, default=25)
    profile.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    compare = sub.add_parser("compare", help="side-by-side Markdown tables of saved make bench runs (bench/out copies)")
    compare.add_argument("runs", nargs="+", type=Path, help="folders holding blocks/chunks/layers/idle .json")
    collector = sub.add_parser("gc", help="CPU per chunk of a chunk stream with the collector as is, frozen, off")
    collector.add_argument("--rounds", type=int, default=4, help="rounds of each mode, alternating")
    collector.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    idle = sub.add_parser("idle", help="CPU used by a connected idle pair of agents")
    idle.add_argument("--seconds", type=float, default=10.0)
    idle.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return parser


def _emit(report: dict[str, Any], text: str, as_json: bool) -> None:
    if as_json:
        print(text, file=sys.stderr)
        print(json.dumps(report))
    else:
        print(text)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if getattr(args, "plot", None) and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install -e '.[bench]' (make bench does)")
    if args.command == "blocks":
        from . import report as report_mod
        from .blocks import Options, run_blocks

        opts = Options(
            quick=args.quick, iters=args.iters, rounds=args.rounds, nixl=not args.no_nixl, compat=not args.no_compat,
            progress=not args.json,
            modes=("tcp",) if args.tcp else ("shm", "tcp"), nixl_error_handling=args.nixl_error_handling,
        )
        result = run(run_blocks(opts))
        _emit(result, report_mod.table(result), args.json)
        if args.plot:
            from .plot import plot_blocks

            plot_blocks(result, args.plot)
    elif args.command == "chunks":
        from .chunks import run_chunks
        from .chunks import table as chunk_table

        result = run(run_chunks(args.quick, ("tcp",) if args.tcp else ("shm", "tcp"), zmq=not args.no_zmq,
                                progress=not args.json))
        _emit(result, chunk_table(result), args.json)
        if args.plot:
            from .plot import plot_chunks

            plot_chunks(result, args.plot)
    elif args.command == "layers":
        from .layers import run_layers
        from .layers import table as layers_table

        result = run(run_layers(args.quick, nixl=not args.no_nixl))
        _emit(result, layers_table(result), args.json)
    elif args.command == "profile":
        from .profile import run_profile
        from .profile import table as profile_table

        result = run(run_profile(args.kind, args.writes, args.top))
        _emit(result, profile_table(result), args.json)
    elif args.command == "compare":
        from .compare import compare

        print(compare(args.runs))
    elif args.command == "gc":
        from .collector import run_gc
        from .collector import table as gc_table

        result = run(run_gc(args.rounds))
        _emit(result, gc_table(result), args.json)
    elif args.command == "idle":
        from .idle import run_idle, table

        result = run(run_idle(args.seconds))
        _emit(result, table(result), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
