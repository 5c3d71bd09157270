"""The one exception hierarchy of omni_async.

Every error the library raises on purpose derives from :class:`OmniAsyncError`, so a caller can
catch the family at once or one precise reason.  Errors that travel between peers carry a
stable ``code`` (see :mod:`omni_async.wire`) so the other side can rebuild the same type.
"""

from __future__ import annotations

REMOTE_ERRORS: dict[str, type[OmniAsyncError]] = {}
"""Error types a peer may name in a rejection or a failed acknowledgement, by code.  A class
joins by declaring ``remote=True`` (``class X(Base, remote=True)``); codes must be unique."""


class OmniAsyncError(Exception):
    """Base class of every error raised by omni_async."""

    code: str = "error"

    def __init_subclass__(cls, *, remote: bool = False, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if remote:
            taken = REMOTE_ERRORS.setdefault(cls.code, cls)
            if taken is not cls:
                raise TypeError(f"error code {cls.code!r} of {cls.__name__} is taken by {taken.__name__}")


REMOTE_ERRORS[OmniAsyncError.code] = OmniAsyncError  # the base class cannot register itself


class ConfigError(OmniAsyncError, ValueError):
    """A configuration value is missing, has the wrong type or is out of range."""

    code = "config"


class ClosedError(OmniAsyncError, remote=True):
    """The object was closed; no new work is accepted."""

    code = "closed"


class ProtocolError(OmniAsyncError, remote=True):
    """A message from a peer is malformed, oversized, of an unknown kind or out of bounds."""

    code = "protocol"


class HandshakeError(OmniAsyncError):
    """The control-plane handshake with a peer did not succeed."""

    code = "handshake"


class HandshakeTimeout(HandshakeError, TimeoutError):
    """The peer did not answer the handshake in time."""

    code = "handshake_timeout"


class HandshakeRejected(HandshakeError, remote=True):
    """The peer refused the handshake; ``reason`` is the text it sent."""

    code = "rejected"


class VersionMismatch(HandshakeRejected, remote=True):
    """The two sides speak different protocol versions."""

    code = "version"


class FingerprintMismatch(HandshakeRejected, remote=True):
    """Both sides have a config fingerprint and they differ."""

    code = "fingerprint"


class LayoutMismatch(HandshakeRejected, remote=True):
    """The two regions have different ``block_len``."""

    code = "layout"


class AlreadyConnected(HandshakeRejected, remote=True):
    """A handshake lost to another one between the same two peers (both dialled at once, or a
    repeated connect).  The pair is (or is about to be) joined through the other connection."""

    code = "already_connected"


class PeerError(OmniAsyncError):
    """Base class of errors about one peer."""

    code = "peer"


class UnknownPeer(PeerError, KeyError, remote=True):
    """No peer with this id is connected."""

    code = "unknown_peer"

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "unknown peer"


class PeerLost(PeerError, remote=True):
    """The peer left, died, or stopped answering heartbeats."""

    code = "peer_lost"


class TransferError(OmniAsyncError):
    """Base class of errors that end one transfer."""

    code = "transfer"


class TransferFailed(TransferError, remote=True):
    """The transfer did not complete; the reason says why (often sent by the receiver)."""

    code = "failed"


class TransferCancelled(TransferError, remote=True):
    """The transfer was cancelled by its owner before it completed."""

    code = "cancelled"


class TransferRefused(TransferError, remote=True):
    """The receiver refused the transfer (e.g. its key is awaited from another peer)."""

    code = "refused"


class BufferFull(TransferRefused, remote=True):
    """The receiver's buffer for payloads nobody asked for yet is full; try again later."""

    code = "buffer_full"


class ReadsNotAllowed(TransferRefused, remote=True):
    """The peer does not allow reads of its region (its ``allow_reads`` is off)."""

    code = "reads_not_allowed"


class DeadlineExceeded(TransferError, TimeoutError, remote=True):
    """A request or transfer made no progress within its deadline."""

    code = "deadline"


class InvalidBlocks(TransferError, ValueError, remote=True):
    """Block index lists are unequal in length or name a block outside a region."""

    code = "invalid_blocks"


class InvalidMessage(TransferError, ValueError, remote=True):
    """A chunk message exceeds a wire limit or the receiver's announced ``max_message_bytes``
    (raised by the sender before anything is sent)."""

    code = "invalid_message"


class InvalidNotice(TransferError, ValueError):
    """A write's notice is not bytes or exceeds the receiver's announced ``max_notice_bytes``
    (raised by the sender before anything is sent)."""

    code = "invalid_notice"


def error_from_code(code: str, reason: str) -> OmniAsyncError:
    """Rebuild the error a peer reported; an unknown code becomes :class:`TransferFailed`."""
    return REMOTE_ERRORS.get(code, TransferFailed)(reason)
