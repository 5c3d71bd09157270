"""``keygen``: a ZeroMQ CURVE key pair for ``agent.curve_secret_key`` / ``curve_allowed_keys``."""

from __future__ import annotations

import argparse
import sys

from .output import EXIT_OK, emit_json


def cmd_keygen(args: argparse.Namespace) -> int:
    from ..auth import generate_keypair

    public, secret = generate_keypair()
    if args.json:
        emit_json({"public_key": public, "secret_key": secret})
    else:
        print(f"public key: {public}")
        print(f"secret key: {secret}")
        print("# the secret key goes in this side's agent.curve_secret_key (keep it private);\n"
              "# the public key goes in every peer's agent.curve_allowed_keys", file=sys.stderr)
    return EXIT_OK

