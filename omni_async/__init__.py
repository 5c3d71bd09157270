"""omni_async: an asyncio-native connector for KV-cache blocks and per-request chunks.

Data moves over UCX (``ucxx``), peers meet over ZeroMQ; every transfer is awaitable.

The names below load on first use: importing a sans-I/O module (``omni_async.wire``,
``.region``, ``.serde``, ``.handshake``, ``.session``, ``.errors``, ``.config``) loads neither
ucxx nor zmq.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .agent import Agent, PeerEvent
    from .config import AgentConfig, load_config
    from .errors import (
        AlreadyConnected,
        BufferFull,
        ClosedError,
        ConfigError,
        DeadlineExceeded,
        FingerprintMismatch,
        HandshakeError,
        HandshakeRejected,
        HandshakeTimeout,
        InvalidBlocks,
        InvalidMessage,
        InvalidNotice,
        LayoutMismatch,
        OmniAsyncError,
        PeerLost,
        ProtocolError,
        ReadsNotAllowed,
        TransferCancelled,
        TransferError,
        TransferFailed,
        TransferRefused,
        UnknownPeer,
        VersionMismatch,
    )
    from .region import BlockRegion, RegionSet, config_fingerprint
    from .session import SessionEvent
    from .transport import Transfer
    from .transport.notices import Notice

__version__ = "0.1.0"

_HOMES: dict[str, str] = {
    "Agent": ".agent",
    "PeerEvent": ".agent",
    "AgentConfig": ".config",
    "load_config": ".config",
    "BlockRegion": ".region",
    "RegionSet": ".region",
    "config_fingerprint": ".region",
    "SessionEvent": ".session",
    "Transfer": ".transport",
    "Notice": ".transport.notices",
}
"""Where each public name that is not an error lives (the errors live in :mod:`.errors`)."""


def __getattr__(name: str) -> Any:
    """Import the module that defines ``name`` on first use (PEP 562)."""
    home = _HOMES.get(name, ".errors" if name in __all__ else None)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "Agent",
    "AgentConfig",
    "AlreadyConnected",
    "BlockRegion",
    "BufferFull",
    "ClosedError",
    "ConfigError",
    "DeadlineExceeded",
    "FingerprintMismatch",
    "HandshakeError",
    "HandshakeRejected",
    "HandshakeTimeout",
    "InvalidBlocks",
    "InvalidMessage",
    "InvalidNotice",
    "LayoutMismatch",
    "Notice",
    "OmniAsyncError",
    "PeerEvent",
    "PeerLost",
    "ProtocolError",
    "ReadsNotAllowed",
    "RegionSet",
    "SessionEvent",
    "Transfer",
    "TransferCancelled",
    "TransferError",
    "TransferFailed",
    "TransferRefused",
    "UnknownPeer",
    "VersionMismatch",
    "config_fingerprint",
    "load_config",
]
