"""``top``: the live view of a service, read from its metrics endpoint (see :mod:`omni_async.top`)."""

from __future__ import annotations

import argparse

from .output import EXIT_FAILED, EXIT_OK, EXIT_USAGE, err


def cmd_top(args: argparse.Namespace) -> int:
    from .. import top
    from ..config import ServiceConfig, load_config
    from ..errors import ConfigError

    target = args.target
    if target is None:
        try:
            agent = load_config(path=args.config, schema=ServiceConfig).agent
        except ConfigError as exc:
            err(f"config error: {exc}")
            return EXIT_FAILED
        if not agent.metrics_port:
            err("no metrics endpoint: give PORT, HOST:PORT or a URL, or a config with agent.metrics_port")
            return EXIT_USAGE
        host = "127.0.0.1" if agent.host in ("0.0.0.0", "*", "::", "[::]") else agent.host
        target = f"{host}:{agent.metrics_port}"
    if args.json and not args.once:
        err("--json needs --once (the live view is for terminals)")
        return EXIT_USAGE
    try:
        return top.run(top.metrics_url(target), interval=args.interval, window=args.window, once=args.once,
                       as_json=args.json)
    except KeyboardInterrupt:
        return EXIT_OK  # Ctrl-C is how one leaves the live view

