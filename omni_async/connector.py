"""Connectors: keyed payloads between services, ``put`` on one side and ``get`` on the other.

A connector is created from a spec shaped like the serving stacks' stage connector config,
``{"name": "ucx", "extra": {...}}``, through a registry (:func:`register_connector`,
:func:`create_connector`).  The default, :class:`UcxConnector`, sends each payload as one chunk
message over the agent's UCX lanes (header + out-of-band array frames, see :mod:`serde`).

Receiving side contract: a payload that arrives before anyone asked for it is buffered, up to
``max_buffered_bytes``; past that its acknowledgement is held back until ``get`` frees space,
so the sender's ``put`` (which resolves on that acknowledgement) is back-pressured: nothing is
dropped.  A payload that fails to decode fails the sender's ``put`` and the local ``get`` of
that key with :class:`~omni_async.errors.ProtocolError`.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import msgspec
import xxhash

from . import serde
from .agent import Agent, PeerEvent
from .config import ConnectorSpec
from .errors import (
    ClosedError,
    ConfigError,
    DeadlineExceeded,
    OmniAsyncError,
    ProtocolError,
    TransferCancelled,
)
from .transport import Frames, Transfer

log = logging.getLogger(__name__)


class Connector(ABC):
    """Moves keyed payloads (see :mod:`omni_async.serde`) between this service and its peers."""

    name: ClassVar[str]
    Options: ClassVar[type[msgspec.Struct]]

    @abstractmethod
    def put_nowait(self, peer_id: str, key: str, payload: serde.Payload) -> Transfer:
        """Start sending ``payload`` under ``key``; the transfer settles on the receiver's ack.

        The payload's arrays are borrowed until then.  Raises ``TypeError`` for a payload that
        cannot travel and the transport's errors (``UnknownPeer``, ``ClosedError``).
        """

    async def put(self, peer_id: str, key: str, payload: serde.Payload) -> None:
        """Send and wait for the receiver's acknowledgement."""
        await self.put_nowait(peer_id, key, payload)

    @abstractmethod
    def wait_for(self, key: str, *, source: str | None = None) -> asyncio.Future[dict[str, Any]]:
        """A future for the payload stored under ``key`` (resolved at once if it is buffered).

        With ``source``, the future fails with ``PeerLost`` if that peer leaves first.
        Cancelling the future withdraws the wait.
        """

    async def get(self, key: str, *, timeout: float | None = None, source: str | None = None) -> dict[str, Any]:
        """Wait for the payload stored under ``key``; :class:`DeadlineExceeded` after ``timeout``."""
        future = self.wait_for(key, source=source)
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise DeadlineExceeded(f"no payload for {key!r} within {timeout}s") from None

    @abstractmethod
    def discard(self, prefix: str, error: OmniAsyncError | None = None, *, refuse_later: bool = False) -> int:
        """Drop buffered payloads and fail waits whose key starts with ``prefix``; return how many.

        With ``refuse_later``, payloads with that prefix that arrive afterwards are refused
        (their sender's ``put`` fails with ``TransferCancelled``) instead of buffered.
        """

    @abstractmethod
    async def close(self) -> None:
        """Fail every wait with :class:`ClosedError` and drop buffered payloads.  Idempotent."""


_REGISTRY: dict[str, Callable[..., Connector]] = {}


def register_connector(name: str) -> Callable[[type[Connector]], type[Connector]]:
    """Class decorator: make a connector available to :func:`create_connector` as ``name``."""

    def decorate(cls: type[Connector]) -> type[Connector]:
        if name in _REGISTRY:
            raise ValueError(f"a connector named {name!r} is already registered")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def create_connector(spec: ConnectorSpec | dict[str, Any], agent: Agent) -> Connector:
    """Build the connector a spec names; unknown names and bad options raise :class:`ConfigError`."""
    if isinstance(spec, dict):
        try:
            spec = msgspec.convert(spec, ConnectorSpec)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"invalid connector spec: {exc}") from None
    factory = _REGISTRY.get(spec.name)
    if factory is None:
        raise ConfigError(f"unknown connector {spec.name!r}; registered: {sorted(_REGISTRY)}")
    options_type: type[msgspec.Struct] = getattr(factory, "Options", msgspec.Struct)
    try:
        options = msgspec.convert(spec.extra, options_type, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid options for connector {spec.name!r}: {exc}") from None
    return factory(agent, options)


class UcxOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Options of the built-in ``ucx`` connector."""

    max_buffered_bytes: int = 256 << 20
    """Payload bytes buffered before acknowledgements are held back."""
    checksum: bool = False
    """End-to-end xxh3-64 of every payload (header and frames), checked by the receiver.
    Both sides must agree."""
    max_refused: int = 65536
    """How many refused prefixes (cleaned-up requests) are remembered."""


class _Stored(msgspec.Struct):
    payload: dict[str, Any]
    nbytes: int


@register_connector("ucx")
class UcxConnector(Connector):
    """The default connector: payloads as chunk messages over the agent's UCX lanes."""

    Options = UcxOptions

    def __init__(self, agent: Agent, options: UcxOptions | None = None) -> None:
        self.agent = agent
        self.options = options or UcxOptions()
        self._loop = asyncio.get_running_loop()
        self._stored: dict[str, _Stored] = {}
        self._stored_bytes = 0
        self._waiters: dict[str, tuple[asyncio.Future[dict[str, Any]], str | None]] = {}
        self._space: list[asyncio.Future[None]] = []
        self._refused: OrderedDict[str, None] = OrderedDict()
        self._closed = False
        agent.set_message_sink(self._on_message)
        agent.add_peer_listener(self._on_peer)

    @property
    def buffered(self) -> tuple[int, int]:
        """``(payloads, bytes)`` received and not taken yet."""
        return len(self._stored), self._stored_bytes

    @property
    def waiting(self) -> int:
        """Keys someone is waiting for."""
        return len(self._waiters)

    def put_nowait(self, peer_id: str, key: str, payload: serde.Payload) -> Transfer:
        if self._closed:
            raise ClosedError("connector is closed")
        header, frames = serde.encode(payload)
        if self.options.checksum:
            header = _digest(header, frames) + header
        return self.agent.send_message(peer_id, key, header, frames)

    def wait_for(self, key: str, *, source: str | None = None) -> asyncio.Future[dict[str, Any]]:
        future: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        if self._closed:
            future.set_exception(ClosedError("connector is closed"))
            return future
        stored = self._stored.pop(key, None)
        if stored is not None:
            self._release(stored.nbytes)
            future.set_result(stored.payload)
            return future
        if key in self._waiters:
            raise ValueError(f"somebody already waits for {key!r}")
        self._waiters[key] = (future, source)
        future.add_done_callback(lambda _f: self._withdraw(key, future))
        return future

    def _withdraw(self, key: str, future: asyncio.Future[dict[str, Any]]) -> None:
        entry = self._waiters.get(key)
        if entry is not None and entry[0] is future:
            del self._waiters[key]

    def discard(self, prefix: str, error: OmniAsyncError | None = None, *, refuse_later: bool = False) -> int:
        count = 0
        for key in [k for k in self._stored if k.startswith(prefix)]:
            self._release(self._stored.pop(key).nbytes)
            count += 1
        for key in [k for k in self._waiters if k.startswith(prefix)]:
            future, _ = self._waiters.pop(key)
            if not future.done():
                future.set_exception(error or TransferCancelled(f"{key!r} discarded"))
                count += 1
        if refuse_later:
            self._refused[prefix] = None
            while len(self._refused) > self.options.max_refused:
                self._refused.popitem(last=False)
        return count

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.discard("", ClosedError("connector closed"))
        self._release(0, everything=True)

    # -- receiving ------------------------------------------------------------------------------
    def _on_message(self, peer_id: str, key: str, meta: bytes, frames: Frames) -> Awaitable[None] | None:
        if self._closed:
            raise ClosedError("connector closed")
        if self._refused and key[: key.rfind(":") + 1] in self._refused:
            raise TransferCancelled(f"{key!r} belongs to a request that was cleaned up")
        try:
            if self.options.checksum:
                meta = _verified(meta, frames)
            payload = serde.decode(meta, frames)
        except ProtocolError as exc:
            log.warning("invalid payload %r from %s: %s", key, peer_id, exc)
            entry = self._waiters.pop(key, None)
            if entry is not None and not entry[0].done():
                entry[0].set_exception(ProtocolError(f"invalid payload {key!r} from {peer_id!r}: {exc}"))
            raise
        entry = self._waiters.pop(key, None)
        if entry is not None and not entry[0].done():
            entry[0].set_result(payload)
            return None
        if key in self._stored:
            raise ProtocolError(f"a payload for {key!r} is already buffered")
        nbytes = sum(frame.nbytes for frame in frames)
        self._stored[key] = _Stored(payload, nbytes)
        self._stored_bytes += nbytes
        if self._stored_bytes <= self.options.max_buffered_bytes:
            return None
        space: asyncio.Future[None] = self._loop.create_future()
        self._space.append(space)
        return space

    def _release(self, nbytes: int, *, everything: bool = False) -> None:
        self._stored_bytes -= nbytes
        while self._space and (everything or self._stored_bytes <= self.options.max_buffered_bytes):
            space = self._space.pop(0)
            if not space.done():
                space.set_result(None)

    def _on_peer(self, event: PeerEvent) -> None:
        if event.kind != "left":
            return
        for future, source in list(self._waiters.values()):
            if source == event.peer_id and not future.done():
                future.set_exception(event.error or ClosedError(f"peer {event.peer_id!r} left"))


_DIGEST_BYTES = 8


def _digest(header: bytes, frames: list[Any]) -> bytes:
    """xxh3-64 of a payload's header and frames, 8 bytes big-endian."""
    hasher = xxhash.xxh3_64(header)
    for frame in frames:
        hasher.update(frame)
    return hasher.digest()


def _verified(meta: bytes, frames: Frames) -> bytes:
    """Strip and check the digest :func:`_digest` put in front of ``meta``; return the header."""
    if len(meta) < _DIGEST_BYTES:
        raise ProtocolError("payload has no checksum (is checksum on at both ends?)")
    digest, header = meta[:_DIGEST_BYTES], meta[_DIGEST_BYTES:]
    if _digest(header, list(frames)) != digest:
        raise ProtocolError("payload checksum mismatch: the data was corrupted in transit")
    return header
