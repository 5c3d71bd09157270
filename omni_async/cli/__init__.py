"""``omni-async``: the command line of omni_async (also ``python -m omni_async.cli``).

Commands (``omni-async COMMAND --help`` explains each):

* ``demo``: the example sender/receiver pair (``examples/demo.py``, needs the repository checkout);
* ``recv``: serve a ConnectorService, print its address, report every chunk received, until Ctrl-C;
* ``send ADDRESS``: connect to a ``recv``, write KV blocks, stream chunks, print a summary;
* ``demo-cluster``: etcd and four agents on loopback: discovery, then a verified transfer per pair;
* ``bench``: run ``python -m bench ...`` from the checkout;
* ``top [TARGET]``: a live view of a service's peers, throughput, failures and streams, read from
  its metrics endpoint (``--once --json``: one snapshot);
* ``keygen``: a ZeroMQ CURVE key pair for ``agent.curve_secret_key`` / ``curve_allowed_keys``;
* ``config check [FILE]``: load a config like a service would and print the effective values,
  or the error naming the field and value; ``config docs``: the field reference.

Conventions: results go to stdout, diagnostics to stderr; ``--json`` prints JSON objects (one per
line for streams) instead of text.  Exit status: 0 success, 1 failure (bad config, failed
transfer, verification mismatch), 2 usage error or missing checkout, 130 interrupted.  Every
network operation is bounded; Ctrl-C (or SIGTERM) stops the command and closes its service.

Layout: :mod:`.parser` (flags), one module per command group (:mod:`.transfer`: recv/send,
:mod:`.configtool`: config check/docs, :mod:`.monitor`: top, :mod:`.keys`: keygen,
:mod:`.checkout`: demo/bench, :mod:`.cluster`: demo-cluster), :mod:`.output` (exit statuses,
printing) and :mod:`.running` (signals, the loop).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable

from .configtool import BEGIN_MARK as _BEGIN_MARK
from .configtool import END_MARK as _END_MARK
from .configtool import config_reference, explain_config_error, to_toml
from .output import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE
from .parser import build_parser, parse_size

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "_BEGIN_MARK", "_END_MARK", "build_parser",
           "config_reference", "explain_config_error", "main", "parse_size", "to_toml"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``omni-async``; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.verbose:
        import logging

        logging.basicConfig(level=logging.DEBUG if args.verbose > 1 else logging.INFO, stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # e.g. `omni-async recv | head`
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at exit
        return EXIT_FAILED


