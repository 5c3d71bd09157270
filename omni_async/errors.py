"""The one exception hierarchy of omni_async.

Every error the library raises on purpose derives from :class:`OmniAsyncError`, so a caller can
catch the family at once or one precise reason.  Errors that travel between peers carry a
stable ``code`` (see :mod:`omni_async.wire`) so the other side can rebuild the same type.
"""

from __future__ import annotations

REMOTE_ERRORS: dict[str, type[OmniAsyncError]] = {}
"""Error types a peer may name in a rejection or a failed acknowledgement, by code.  A class
joins by declaring ``remote=True`` (``class X(Base, code="x", remote=True)``); codes must be unique."""


class OmniAsyncError(Exception):
    """Base class of every error raised by omni_async."""

    code: str = "error"
    """Stable name of the error, set by ``code=`` in the class statement."""

    def __init_subclass__(cls, *, code: str | None = None, remote: bool = False, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code = code
        if remote:
            taken = REMOTE_ERRORS.setdefault(cls.code, cls)
            if taken is not cls:
                raise TypeError(f"error code {cls.code!r} of {cls.__name__} is taken by {taken.__name__}")


REMOTE_ERRORS[OmniAsyncError.code] = OmniAsyncError  # the base class cannot register itself


class ConfigError(OmniAsyncError, ValueError, code="config"):
    """A configuration value is missing, has the wrong type or is out of range."""


class ClosedError(OmniAsyncError, code="closed", remote=True):
    """The object was closed; no new work is accepted."""


class ProtocolError(OmniAsyncError, code="protocol", remote=True):
    """A message from a peer is malformed, oversized, of an unknown kind or out of bounds."""


class HandshakeError(OmniAsyncError, code="handshake"):
    """The control-plane handshake with a peer did not succeed."""


class HandshakeTimeout(HandshakeError, TimeoutError, code="handshake_timeout"):
    """The peer did not answer the handshake in time."""


class HandshakeRejected(HandshakeError, code="rejected", remote=True):
    """The peer refused the handshake; ``reason`` is the text it sent."""


class VersionMismatch(HandshakeRejected, code="version", remote=True):
    """The two sides speak different protocol versions."""


class FingerprintMismatch(HandshakeRejected, code="fingerprint", remote=True):
    """Both sides have a config fingerprint and they differ."""


class LayoutMismatch(HandshakeRejected, code="layout", remote=True):
    """The two regions have different ``block_len``."""


class AlreadyConnected(HandshakeRejected, code="already_connected", remote=True):
    """A handshake lost to another one between the same two peers (both dialled at once, or a
    repeated connect).  The pair is (or is about to be) joined through the other connection."""


class PeerError(OmniAsyncError, code="peer"):
    """Base class of errors about one peer."""


class UnknownPeer(PeerError, KeyError, code="unknown_peer", remote=True):
    """No peer with this id is connected."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "unknown peer"


class PeerLost(PeerError, code="peer_lost", remote=True):
    """The peer left, died, or stopped answering heartbeats."""


class TransferError(OmniAsyncError, code="transfer"):
    """Base class of errors that end one transfer."""


class TransferFailed(TransferError, code="failed", remote=True):
    """The transfer did not complete; the reason says why (often sent by the receiver)."""


class TransferCancelled(TransferError, code="cancelled", remote=True):
    """The transfer was cancelled by its owner before it completed."""


class TransferRefused(TransferError, code="refused", remote=True):
    """The receiver refused the transfer (e.g. its key is awaited from another peer)."""


class BufferFull(TransferRefused, code="buffer_full", remote=True):
    """The receiver's buffer for payloads nobody asked for yet is full; try again later."""


class BatchRefused(TransferRefused, code="batch_refused", remote=True):
    """The receiver did not take a batch of payloads whole (see :mod:`omni_async.batch`); the
    sender then sends each payload alone.  Never reaches a caller."""


class ReadsNotAllowed(TransferRefused, code="reads_not_allowed", remote=True):
    """The peer does not allow reads of its region (its ``allow_reads`` is off)."""


class DeadlineExceeded(TransferError, TimeoutError, code="deadline", remote=True):
    """A request or transfer made no progress within its deadline."""


class InvalidBlocks(TransferError, ValueError, code="invalid_blocks", remote=True):
    """Block index lists are unequal in length or name a block outside a region."""


class InvalidMessage(TransferError, ValueError, code="invalid_message", remote=True):
    """A chunk message exceeds a wire limit or the receiver's announced ``max_message_bytes``
    (raised by the sender before anything is sent)."""


class InvalidNotice(TransferError, ValueError, code="invalid_notice"):
    """A write's notice is not bytes or exceeds the receiver's announced ``max_notice_bytes``
    (raised by the sender before anything is sent)."""


def error_from_code(code: str, reason: str) -> OmniAsyncError:
    """Rebuild the error a peer reported; an unknown code becomes :class:`TransferFailed`."""
    return REMOTE_ERRORS.get(code, TransferFailed)(reason)
