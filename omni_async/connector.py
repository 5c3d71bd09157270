"""Connectors: keyed payloads between services, ``put`` on one side and ``get`` on the other.

A connector is created from a spec shaped like the serving stacks' stage connector config,
``{"name": "ucx", "extra": {...}}``, through a registry (:func:`register_connector`,
:func:`create_connector`).  The default, :class:`UcxConnector`, sends each payload as one chunk
message over the agent's UCX lanes (header + out-of-band array frames, see :mod:`serde`), or,
given several at once (:meth:`Connector.put_many_nowait`), small ones together as a batch
(:mod:`omni_async.batch`).

Receiving side contract: a payload that arrives before anyone asked for it is buffered, up to
``max_buffered_bytes`` (checked before it is stored); past that its acknowledgement is held back
until ``get`` frees space, so the sender's ``put`` (which resolves on that acknowledgement) is
back-pressured (for at most the agent's ``transfer_timeout``: then the payload is dropped and
the ``put`` fails with ``DeadlineExceeded``; a payload whose sender gives it up first, its own
deadline or a cancel, is dropped when the sender's ``Abort`` arrives).  As many bytes again
may wait held; past that, or past ``max_buffered_payloads``, the payload is refused and the
sender's ``put`` fails with :class:`~omni_async.errors.BufferFull`.  A payload's bytes are its
frames' and, for a large header, a bound on what its decoded values take (:func:`charge`).
Nothing is dropped silently: a payload that fails to decode fails the sender's ``put`` and the
local ``get`` of that key with :class:`~omni_async.errors.ProtocolError`.

Payload arrays are the receiver's to keep: large ones from a peer on this host are views of
the agent's receive pool (:mod:`omni_async.transport.pool`), whose memory is reused only once
the last reference to them is dropped; a reader that keeps them makes later payloads arrive
in fresh arrays instead, it never holds up a sender.

Keys belong to their sender: a ``get``/``wait_for`` naming ``source`` is given only that
peer's payload; another peer's payload for the key is refused
(:class:`~omni_async.errors.TransferRefused` to its sender), or, if it was acknowledged before
the wait began, dropped when the wait takes ``source``'s.  A peer that leaves releases what
it owned: waits naming it fail with :class:`~omni_async.errors.PeerLost`, its held payloads are
refused, and its acknowledged ones are dropped after ``orphan_timeout``.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import pairwise
from typing import Any, ClassVar, Final

import msgspec
import xxhash

from . import batch, serde
from .agent import Agent, PeerEvent
from .config import ConnectorSpec, Positive, PositiveSeconds
from .errors import (
    BatchRefused,
    BufferFull,
    ClosedError,
    ConfigError,
    DeadlineExceeded,
    OmniAsyncError,
    PeerLost,
    ProtocolError,
    TransferCancelled,
    TransferRefused,
)
from .transport import Frames, Transfer
from .transport.limits import check_key

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

    def put_many_nowait(self, peer_id: str, items: Sequence[tuple[str, serde.Payload]], done: PutDone) -> None:
        """Start sending several ``(key, payload)`` items to one peer; ``done(index, error)``
        runs once for each item when it settles (``error`` None: acknowledged, else what
        :meth:`put_nowait` would have raised or failed it with), possibly before this returns.

        A connector may send them together; each item keeps the outcome it would have alone.
        This default sends each alone."""
        for index, (key, payload) in enumerate(items):
            _report(index, partial(self.put_nowait, peer_id, key, payload), done)

    @abstractmethod
    def wait_for(self, key: str, *, source: str | None = None) -> asyncio.Future[dict[str, Any]]:
        """A future for the payload stored under ``key`` (resolved at once if it is buffered).

        With ``source``, the future fails with ``PeerLost`` if that peer leaves first.
        Cancelling the future withdraws the wait.
        """

    def take_nowait(self, key: str, *, source: str | None = None) -> dict[str, Any] | None:
        """The payload buffered under ``key`` (from ``source``, if given), taken now; None if
        none is (then :meth:`wait_for` delivers it).  Spares a future and a loop hop per
        payload that arrived before anyone asked; this default never has one at hand."""
        return None

    async def get(self, key: str, *, timeout: float | None = None, source: str | None = None) -> dict[str, Any]:
        """Wait for the payload stored under ``key``; :class:`DeadlineExceeded` after ``timeout``."""
        future = self.wait_for(key, source=source)
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise DeadlineExceeded(f"no payload for {key!r} within {timeout}s") from None

    @abstractmethod
    def discard(self, prefix: str, error: OmniAsyncError | None = None, *, refuse_later: bool = False,
                keep_buffered: bool = False) -> int:
        """Drop buffered payloads (unless ``keep_buffered``) and fail waits whose key is
        ``prefix`` followed by an index (decimal digits, see :func:`key_prefix`); return how
        many.  A key that merely starts with ``prefix`` is not one of them (request
        ``"a:s:x"``'s keys ``"a:s:x:s:0"`` are not under request ``"a"``'s prefix ``"a:s:"``).

        With ``refuse_later``, payloads under that prefix that arrive afterwards are refused
        (their sender's ``put`` fails with ``TransferCancelled``) instead of buffered, and waits
        for its keys made afterwards fail at once with ``TransferCancelled`` naming the first
        such discard's ``error`` (nothing could arrive for them).
        """

    @abstractmethod
    async def close(self) -> None:
        """Fail every wait with :class:`ClosedError` and drop buffered payloads.  Idempotent."""


def key_prefix(key: str) -> str | None:
    """The prefix ``key`` is under: all of it up to its last ``":"`` (included) when what
    follows is an index (ASCII decimal digits), else None.  The one rule by which keys are
    matched against a prefix (:meth:`Connector.discard`)."""
    cut = key.rfind(":") + 1
    index = key[cut:]
    return key[:cut] if index.isascii() and index.isdecimal() else None


PutDone = Callable[[int, BaseException | None], None]
"""``done(index, error)``: item ``index`` of a :meth:`Connector.put_many_nowait` settled."""


def _report(index: int, start: Callable[[], Transfer], done: PutDone) -> None:
    """Start item ``index``'s transfer with ``start()``; ``done(index, error)`` once it
    settles, or at once with what ``start`` raised (it never raises itself)."""
    try:
        transfer = start()
    except Exception as exc:
        done(index, exc)
        return
    transfer.add_done_callback(partial(_settled, done, index))


def _settled(done: PutDone, index: int, transfer: Transfer) -> None:
    done(index, transfer.error())


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
    """Payload bytes buffered before acknowledgements are held back; as many again may wait with
    their acknowledgement held, past that a payload is refused with BufferFull.  A payload counts
    its frames' bytes, and, for a header longer than :data:`FREE_HEADER_BYTES`, what its
    decoded values may take (see :func:`charge`)."""
    max_buffered_payloads: Positive = 65536
    """Payloads buffered at once (acknowledged or held); past it a payload is refused with
    BufferFull."""
    orphan_timeout: PositiveSeconds = 30.0
    """Seconds the acknowledged payloads of a peer that left stay buffered for a reader still
    catching up; then they are dropped."""
    checksum: bool = False
    """End-to-end xxh3-64 of every payload (header and frames), checked by the receiver.
    Both sides must agree."""
    max_refused: int = 65536
    """How many refused prefixes (cleaned-up requests) are remembered."""


_Wait = tuple[asyncio.Future[dict[str, Any]], str | None, Callable[[asyncio.Future[dict[str, Any]]], None]]
"""A ``wait_for``: its future, the source it names, and the done callback that withdraws it."""


@dataclass(eq=False, slots=True)
class _Stored:
    """A buffered payload; ``space`` is set while its acknowledgement is held back.  Compared
    and hashed by identity (a key of the held-back table)."""

    key: str
    peer_id: str
    payload: dict[str, Any]
    nbytes: int
    space: asyncio.Future[None] | None


_Encoded = tuple[int, str, bytes, list[Any]]
"""An item of a :meth:`UcxConnector.put_many_nowait` ready to send: its index, key, header and frames."""


@register_connector("ucx")
class UcxConnector(Connector):
    """The default connector: payloads as chunk messages over the agent's UCX lanes."""

    Options = UcxOptions

    def __init__(self, agent: Agent, options: UcxOptions | None = None) -> None:
        self.agent = agent
        self.options = options or UcxOptions()
        self._loop = asyncio.get_running_loop()
        self._stored: dict[str, dict[str, _Stored]] = {}
        """key -> sending peer -> payload (one key may come from several peers; the reader's
        ``source`` picks)."""
        self._count = 0
        self._acked_bytes = 0
        self._held: dict[_Stored, asyncio.TimerHandle] = {}
        """Payloads whose acknowledgement is held back, oldest first, with their expiry."""
        self._held_bytes = 0
        self._waiters: dict[str, _Wait] = {}
        """key -> (future, source, its withdraw callback)."""
        self._refused: OrderedDict[str, str] = OrderedDict()
        """Prefixes discarded with ``refuse_later``, oldest first, with why."""
        self._gone: OrderedDict[str, None] = OrderedDict()
        """Peers that left and have not joined again (a wait for their keys fails at once)."""
        self._orphan_timers: dict[str, asyncio.TimerHandle] = {}
        """Peer that left -> the timer dropping its acknowledged payloads (cancelled if it joins again)."""
        self._closed = False
        agent.set_message_sink(self._on_message, retract=self._retract)
        agent.add_peer_listener(self._on_peer)

    @property
    def buffered(self) -> tuple[int, int]:
        """``(payloads, bytes)`` received and not taken yet (acknowledged or held)."""
        return self._count, self._acked_bytes + self._held_bytes

    @property
    def waiting(self) -> int:
        """Keys someone is waiting for."""
        return len(self._waiters)

    def put_nowait(self, peer_id: str, key: str, payload: serde.Payload) -> Transfer:
        """See :meth:`Connector.put_nowait`; also raises ``ValueError`` for a key that starts
        with ``"\\x00"`` (the connector's own, :data:`omni_async.batch.RESERVED`)."""
        header, frames = self._encode(key, payload)
        return self.agent.send_message(peer_id, key, header, frames)

    def put_many_nowait(self, peer_id: str, items: Sequence[tuple[str, serde.Payload]], done: PutDone) -> None:
        """See :meth:`Connector.put_many_nowait`: small items go together, as many a message as
        travels whole to the peer (:func:`omni_async.batch.plan`, ``Agent.batch_bytes``); a
        batch the receiver does not take whole is sent again one item at a time."""
        encoded: list[_Encoded] = []
        for index, (key, payload) in enumerate(items):
            try:
                check_key(key)  # a key the wire cannot carry fails its own put, never a batch
                header, frames = self._encode(key, payload)
            except Exception as exc:
                done(index, exc)
                continue
            encoded.append((index, key, header, frames))
        try:
            max_bytes = self.agent.batch_bytes(peer_id)
        except OmniAsyncError:  # (an unknown peer: each alone, each fails on its own)
            max_bytes = 0
        sizes = [(sum(frame.nbytes for frame in frames), len(key) + len(header) + 8, len(frames))
                 for _, key, header, frames in encoded]
        for start, end in pairwise([0, *batch.plan(sizes, max_bytes), len(encoded)]):
            if end - start == 1:
                self._send_one(peer_id, encoded[start], done)
            elif end > start:
                self._send_batch(peer_id, encoded[start:end], done)

    def _encode(self, key: str, payload: serde.Payload) -> tuple[bytes, list[Any]]:
        if self._closed:
            raise ClosedError("connector is closed")
        if type(key) is str and key.startswith(batch.RESERVED):
            raise ValueError(f"keys starting with {batch.RESERVED!r} are the connector's own: {key!r}")
        header, frames = serde.encode(payload)
        return self._signed(header, frames), frames

    def _signed(self, meta: bytes, frames: list[Any]) -> bytes:
        """``meta`` with the digest of it and ``frames`` in front, if ``checksum`` is on."""
        return _digest(meta, frames) + meta if self.options.checksum else meta

    def _checked(self, meta: bytes, frames: Frames) -> bytes:
        """What :meth:`_signed` made of ``meta``, its digest checked and stripped (``checksum``
        on); raises :class:`ProtocolError` on a mismatch."""
        return _verified(meta, frames) if self.options.checksum else meta

    def _send_one(self, peer_id: str, item: _Encoded, done: PutDone) -> None:
        index, key, header, frames = item
        _report(index, partial(self.agent.send_message, peer_id, key, header, frames), done)

    def _send_batch(self, peer_id: str, items: list[_Encoded], done: PutDone) -> None:
        meta = batch.encode([batch.Item(key, header, len(frames)) for _, key, header, frames in items])
        meta = self._signed(meta, [])  # (each item's header carries the digest of its frames)
        try:
            transfer = self.agent.send_message(
                peer_id, batch.BATCH_KEY, meta, [frame for *_, frames in items for frame in frames]
            )
        except Exception as exc:
            for index, *_ in items:
                done(index, exc)
            return
        transfer.add_done_callback(partial(self._batch_settled, peer_id, items, done))

    def _batch_settled(self, peer_id: str, items: list[_Encoded], done: PutDone, transfer: Transfer) -> None:
        error = transfer.error()
        if isinstance(error, BatchRefused):  # not taken whole: each alone, for its own outcome
            for item in items:
                self._send_one(peer_id, item, done)
            return
        for index, *_ in items:
            done(index, error)

    def wait_for(self, key: str, *, source: str | None = None) -> asyncio.Future[dict[str, Any]]:
        """See :meth:`Connector.wait_for`.  With ``source``, only that peer's payload for ``key``
        is delivered: others' are refused (their sender's ``put`` fails with
        :class:`TransferRefused` if it is still unacknowledged), and if ``source`` has left
        already the future fails at once with :class:`PeerLost`; so does one for a key of a
        cleaned-up request, with :class:`TransferCancelled` (see :meth:`Connector.discard`)."""
        future: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        if self._closed:
            future.set_exception(ClosedError("connector is closed"))
            return future
        refusal = self._refusal(key)
        if refusal is not None:
            future.set_exception(refusal)
            return future
        stored = self._take(key, source)
        if stored is not None:
            future.set_result(stored.payload)
            return future
        if source is not None and source in self._gone:
            future.set_exception(PeerLost(f"peer {source!r} left before {key!r} arrived"))
            return future
        entry = self._waiters.get(key)
        if entry is not None:
            if not entry[0].done():
                raise ValueError(f"somebody already waits for {key!r}")
            del self._waiters[key]  # given up (cancelled) a moment ago: its withdrawal is still queued
        withdraw = partial(self._withdraw, key)
        self._waiters[key] = (future, source, withdraw)
        future.add_done_callback(withdraw)  # the owner may cancel it
        return future

    def take_nowait(self, key: str, *, source: str | None = None) -> dict[str, Any] | None:
        """See :meth:`Connector.take_nowait`; ``source`` acts as in :meth:`wait_for` (other
        peers' payloads for ``key`` are refused).  None once closed."""
        if self._closed:
            return None
        stored = self._take(key, source)
        return None if stored is None else stored.payload

    def _withdraw(self, key: str, future: asyncio.Future[dict[str, Any]]) -> None:
        entry = self._waiters.get(key)
        if entry is not None and entry[0] is future:
            del self._waiters[key]

    def discard(self, prefix: str, error: OmniAsyncError | None = None, *, refuse_later: bool = False,
                keep_buffered: bool = False) -> int:
        count = self._release(lambda key: key_prefix(key) == prefix, error, buffered=not keep_buffered)
        if refuse_later:
            self._refused.setdefault(prefix, str(error) if error is not None else "discarded")
            while len(self._refused) > self.options.max_refused:
                self._refused.popitem(last=False)
        return count

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for timer in self._orphan_timers.values():
            timer.cancel()
        self._orphan_timers.clear()
        self._release(lambda key: True, ClosedError("connector closed"))

    def _release(self, chosen: Callable[[str], bool], error: OmniAsyncError | None, *, buffered: bool = True) -> int:
        """Drop the buffered payloads (if ``buffered``) and fail the waits of the ``chosen``
        keys; return how many."""
        count = 0
        for key in [k for k in self._stored if buffered and chosen(k)]:
            for stored in list(self._stored[key].values()):
                self._drop(stored, error or TransferCancelled(f"{key!r} discarded"))
                count += 1
        for key in [k for k in self._waiters if chosen(k)]:
            future, _, _ = self._waiters.pop(key)
            if not future.done():
                future.set_exception(error or TransferCancelled(f"{key!r} discarded"))
                count += 1
        self._admit()
        return count

    # -- buffer --------------------------------------------------------------------------------
    def _take(self, key: str, source: str | None) -> _Stored | None:
        """Remove and return the payload for ``key`` (from ``source``, if given; other peers'
        payloads for the key are then refused), acknowledging it if that was held back."""
        candidates = self._stored.get(key)
        if not candidates:
            return None
        if source is None:
            stored: _Stored | None = next(iter(candidates.values()))
        else:
            stored = candidates.get(source)
            for other in [c for c in candidates.values() if c.peer_id != source]:
                log.warning("refused %r from %s: it is awaited from %s", key, other.peer_id, source)
                self._drop(other, TransferRefused(f"{key!r} is awaited from {source!r}, not {other.peer_id!r}"))
        if stored is not None:
            self._remove(stored)
            if stored.space is not None and not stored.space.done():
                stored.space.set_result(None)
            self._admit()
        return stored

    def _remove(self, stored: _Stored) -> None:
        candidates = self._stored[stored.key]
        del candidates[stored.peer_id]
        if not candidates:
            del self._stored[stored.key]
        self._count -= 1
        if stored.space is None:
            self._acked_bytes -= stored.nbytes
        else:
            self._held_bytes -= stored.nbytes
            self._held.pop(stored).cancel()

    def _drop(self, stored: _Stored, error: OmniAsyncError) -> None:
        """Forget a buffered payload; if its acknowledgement was held, its sender gets ``error``."""
        self._remove(stored)
        if stored.space is not None and not stored.space.done():
            stored.space.set_exception(error)

    def _admit(self) -> None:
        """Acknowledge held payloads, oldest first, while they fit in ``max_buffered_bytes``."""
        for stored in list(self._held):
            if self._acked_bytes + stored.nbytes > self.options.max_buffered_bytes:
                return
            self._held.pop(stored).cancel()
            self._held_bytes -= stored.nbytes
            self._acked_bytes += stored.nbytes
            space, stored.space = stored.space, None
            if space is not None and not space.done():
                space.set_result(None)

    def _buffer(self, peer_id: str, key: str, payload: dict[str, Any], nbytes: int) -> asyncio.Future[None] | None:
        """Store a payload nobody waits for yet, checking the limits first: acknowledged at once
        if it fits, held (its acknowledgement back-pressures the sender; at most the agent's
        ``transfer_timeout``, then dropped) if as many bytes again fit, else refused with
        :class:`BufferFull`."""
        candidates = self._stored.setdefault(key, {})
        if peer_id in candidates:
            raise ProtocolError(f"a payload for {key!r} is already buffered")
        limit = self.options.max_buffered_bytes
        if self._count >= self.options.max_buffered_payloads:
            self._forget_empty(key)
            raise BufferFull(f"{self._count} payloads are buffered already (max_buffered_payloads)")
        if not self._held and self._acked_bytes + nbytes <= limit:
            self._store(peer_id, key, payload, nbytes)
            return None
        if self._held_bytes + nbytes > limit:  # (alone over the limit: it could never be admitted)
            self._forget_empty(key)
            raise BufferFull(
                f"a payload of {nbytes} bytes does not fit: {self._acked_bytes + self._held_bytes} bytes are "
                f"buffered already (max_buffered_bytes {limit}, as many again held)"
            )
        space: asyncio.Future[None] = self._loop.create_future()
        stored = candidates[peer_id] = _Stored(key, peer_id, payload, nbytes, space)
        self._count += 1
        self._held_bytes += nbytes
        self._held[stored] = self._loop.call_later(self.agent.config.transfer_timeout, self._expire, stored)
        return space

    def _retract(self, peer_id: str, key: str, pending: asyncio.Future[Any]) -> None:
        """The sender gave up the payload it sent under ``key`` (its deadline, a cancel) while
        we held its acknowledgement (``pending``: the future :meth:`_buffer` returned for it):
        it is dropped, so it is never acknowledged, or delivered, after its sender was told it
        failed.  One acknowledged already stays (it was delivered before the sender gave up),
        and so does a later payload under the same key."""
        stored = self._stored.get(key, {}).get(peer_id)
        if stored is not None and stored.space is pending and stored in self._held:
            self._drop(stored, TransferCancelled(f"{key!r} was given up by its sender"))
            self._admit()

    def _store(self, peer_id: str, key: str, payload: dict[str, Any], nbytes: int) -> None:
        """Buffer a payload, acknowledged (the caller checked the limits)."""
        self._stored.setdefault(key, {})[peer_id] = _Stored(key, peer_id, payload, nbytes, None)
        self._count += 1
        self._acked_bytes += nbytes

    def _expire(self, stored: _Stored) -> None:
        """A payload held as long as its sender waits for the acknowledgement (``transfer_timeout``)
        is dropped: its sender has given up on it."""
        if stored in self._held:
            timeout = self.agent.config.transfer_timeout
            self._drop(stored, DeadlineExceeded(f"{stored.key!r} found no buffer space within {timeout}s"))
            self._admit()

    def _forget_empty(self, key: str) -> None:
        if not self._stored.get(key, True):
            del self._stored[key]

    # -- receiving ------------------------------------------------------------------------------
    def _on_message(self, peer_id: str, key: str, meta: bytes, frames: Frames) -> Awaitable[None] | None:
        if self._closed:
            raise ClosedError("connector closed")
        if key == batch.BATCH_KEY:
            self._on_batch(peer_id, meta, frames)
            return None
        try:
            waiter = self._claim(peer_id, key)
        except TransferRefused as exc:
            log.warning("refused %r from %s: %s", key, peer_id, exc)
            raise
        try:
            payload = serde.decode(self._checked(meta, frames), frames)
        except Exception as exc:  # the codec raises ProtocolError only; anything else is a bug
            if not isinstance(exc, ProtocolError):
                log.error("payload decoder failed on %r from %s", key, peer_id, exc_info=exc)
            log.warning("invalid payload %r from %s: %s", key, peer_id, exc)
            error = ProtocolError(f"invalid payload {key!r} from {peer_id!r}: {exc}")
            if waiter is not None:
                self._hand_over(key, waiter).set_exception(error)
            raise error from None
        if waiter is not None:
            self._hand_over(key, waiter).set_result(payload)
            return None
        return self._buffer(peer_id, key, payload, charge(meta, frames))

    def _claim(self, peer_id: str, key: str) -> _Wait | None:
        """The live wait a payload for ``key`` from ``peer_id`` goes to (None: nobody waits, it
        is buffered).  Raises :class:`TransferCancelled` for a key of a cleaned-up request and
        :class:`TransferRefused` for a key awaited from another peer."""
        refusal = self._refusal(key)
        if refusal is not None:
            raise refusal
        waiter = self._waiters.get(key)
        if waiter is not None and waiter[0].done():
            return None  # withdrawn; its done callback has not run yet
        if waiter is not None and waiter[1] is not None and waiter[1] != peer_id:
            raise TransferRefused(f"{key!r} is awaited from {waiter[1]!r}, not {peer_id!r}")
        return waiter

    def _refusal(self, key: str) -> TransferCancelled | None:
        """Why ``key`` is refused (its prefix was discarded with ``refuse_later``); None if it is not."""
        prefix = key_prefix(key) if self._refused else None
        if prefix is None or prefix not in self._refused:
            return None
        return TransferCancelled(f"{key!r} belongs to a request that was cleaned up: {self._refused[prefix]}")

    def _on_batch(self, peer_id: str, meta: bytes, frames: Frames) -> None:
        """Take every item of a batch now (see :mod:`omni_async.batch`), or none: raises
        :class:`BatchRefused` (the sender sends each alone) if one item would not be taken at
        once (refused, awaited from another peer, buffered already, not decodable, or the
        buffer's limits would hold its acknowledgement back or refuse it), and
        :class:`ProtocolError` for a malformed batch."""
        try:
            items = batch.decode(self._checked(meta, []), len(frames))
        except ProtocolError as exc:
            log.warning("invalid batch from %s: %s", peer_id, exc)
            raise
        decoded: list[tuple[str, dict[str, Any], int, _Wait | None]] = []
        buffered = nbytes = 0
        at = 0
        for item in items:
            key, own = item.key, frames[at : at + item.frames]
            at += item.frames
            try:
                waiter = self._claim(peer_id, key)
            except (TransferCancelled, TransferRefused) as exc:
                raise BatchRefused(str(exc)) from None
            if waiter is None and peer_id in self._stored.get(key, ()):
                raise BatchRefused(f"a payload for {key!r} is buffered already")
            try:
                payload = serde.decode(self._checked(item.header, own), own)
            except Exception:  # sent alone, it fails on its own (and so does its reader's wait)
                raise BatchRefused(f"{key!r} does not decode") from None
            size = charge(item.header, own)
            if waiter is None:
                buffered += 1
                nbytes += size
            decoded.append((key, payload, size, waiter))
        if buffered and (
            self._held
            or self._count + buffered > self.options.max_buffered_payloads
            or self._acked_bytes + nbytes > self.options.max_buffered_bytes
        ):
            raise BatchRefused("the buffer would not take every payload of the batch at once")
        for key, payload, size, waiter in decoded:
            if waiter is not None:
                self._hand_over(key, waiter).set_result(payload)
            else:
                self._store(peer_id, key, payload, size)

    def _hand_over(self, key: str, waiter: _Wait) -> asyncio.Future[dict[str, Any]]:
        """Forget a wait this side is about to settle, and its withdraw callback with it (which
        would only find it gone, a loop turn later); returns its future to settle."""
        del self._waiters[key]
        future, _, withdraw = waiter
        future.remove_done_callback(withdraw)
        return future

    def _on_peer(self, event: PeerEvent) -> None:
        """A peer that left releases what it owned: its held payloads (refused), waits naming it
        as ``source`` (``PeerLost``), and, after ``orphan_timeout``, its acknowledged payloads,
        unless it joined again by then (a reader may still take them: they were acknowledged)."""
        if event.kind == "joined":
            self._gone.pop(event.peer_id, None)
            timer = self._orphan_timers.pop(event.peer_id, None)
            if timer is not None:
                timer.cancel()
            return
        error = event.error if isinstance(event.error, PeerLost) else PeerLost(
            f"peer {event.peer_id!r} left" + (f": {event.error}" if event.error else ""))
        self._gone[event.peer_id] = None
        while len(self._gone) > self.options.max_refused:
            self._gone.popitem(last=False)
        for future, source, _ in list(self._waiters.values()):
            if source == event.peer_id and not future.done():
                future.set_exception(error)
        mine = [s for candidates in self._stored.values() for s in candidates.values() if s.peer_id == event.peer_id]
        for stored in [s for s in mine if s.space is not None]:
            self._drop(stored, error)
        acked = [s for s in mine if s.space is None]
        if acked and not self._closed:
            earlier = self._orphan_timers.pop(event.peer_id, None)
            if earlier is not None:  # (it left twice: these include the payloads that timer held)
                earlier.cancel()
            self._orphan_timers[event.peer_id] = self._loop.call_later(
                self.options.orphan_timeout, self._drop_orphans, event.peer_id, acked)
        self._admit()

    def _drop_orphans(self, peer_id: str, orphans: list[_Stored]) -> None:
        self._orphan_timers.pop(peer_id, None)
        dropped = 0
        for stored in orphans:
            if self._stored.get(stored.key, {}).get(stored.peer_id) is stored:
                self._drop(stored, PeerLost(f"peer {stored.peer_id!r} left"))
                dropped += 1
        if dropped:
            log.info("dropped %d payloads of peers that left %ss ago", dropped, self.options.orphan_timeout)
        self._admit()


FREE_HEADER_BYTES: Final = 64
"""Header bytes of a buffered payload not charged for their decoded values: every small
chunk's header fits (``{"x": array}``: 16 bytes, an adapter's chunk envelope ~64)."""


def charge(header: bytes, frames: Frames) -> int:
    """What a payload counts against ``max_buffered_bytes``: its frames' bytes, plus
    :data:`~omni_async.serde.DECODED_PER_HEADER_BYTE` for each header byte past
    :data:`FREE_HEADER_BYTES`: the most its decoded values may take, so frameless payloads
    whose headers decode into millions of objects fill the buffer, not the memory (a 48 KiB
    header of empty mappings decodes into 3.5 MiB)."""
    extra = len(header) - FREE_HEADER_BYTES
    nbytes = sum(frame.nbytes for frame in frames)
    return nbytes + extra * serde.DECODED_PER_HEADER_BYTE if extra > 0 else nbytes


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
