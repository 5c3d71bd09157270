"""omni_async: an asyncio-native connector for KV-cache blocks and per-request chunks.

Data moves over UCX (``ucxx``), peers meet over ZeroMQ; every transfer is awaitable.
"""

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
    LayoutMismatch,
    OmniAsyncError,
    PeerLost,
    ProtocolError,
    TransferCancelled,
    TransferError,
    TransferFailed,
    TransferRefused,
    UnknownPeer,
    VersionMismatch,
)
from .region import BlockRegion, config_fingerprint
from .transport import Transfer

__version__ = "0.1.0"

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
    "LayoutMismatch",
    "OmniAsyncError",
    "PeerEvent",
    "PeerLost",
    "ProtocolError",
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
