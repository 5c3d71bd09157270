"""``demo-cluster``: etcd and a few agents on loopback, discovery, then a verified transfer per pair."""

from __future__ import annotations

import argparse

from .running import run_async


def cmd_demo_cluster(args: argparse.Namespace) -> int:
    from ..discovery.demo import demo_cluster

    return run_async(demo_cluster(args.agents, args.timeout))
