"""The asyncio part of discovery: an agent's card in etcd, and the group's agents joined to it.

:class:`Discovery` registers the agent's :class:`~omni_async.discovery.card.Card` under a lease
it keeps alive, lists and watches the group, and dials the peers it should (see
:mod:`~omni_async.discovery.membership`); a peer whose card changed (it moved or restarted) is
removed, one whose card vanished is not dialled again but stays joined while it answers
heartbeats (a card also vanishes when etcd expires a living agent's lease: etcd stopped for
longer than the TTL expires every lease once it runs again).  Losing etcd never drops a joined
peer: the session ends, that is logged once, and every ``retry_interval``
a new session is tried (a fresh lease, the card again, a new listing); then it is logged that
discovery resumed.  Uses the ``aetcd`` client (``pip install 'omni_async[discovery]'``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Coroutine
from typing import Any, Self

import aetcd

from ..agent import Agent, PeerEvent
from ..auth import split_address
from ..config import DiscoveryConfig, etcd_host_port
from ..errors import AlreadyConnected, ClosedError, ConfigError, OmniAsyncError, ProtocolError
from ..lifecycle import Startable
from .card import Card, card_key, decode_card, encode_card, group_prefix, peer_id_of
from .membership import Change, Membership, incompatibility, should_dial

__all__ = ["Discovery"]

log = logging.getLogger(__name__)

_CLOSE_S = 2.0
"""Bound on revoking the lease and closing the client at close."""


class EtcdLost(Exception):
    """The etcd session ended (keep-alive refused, the watch stream ended)."""


class Discovery(Startable):
    """Keeps ``agent`` registered in, and joined to, its etcd group (see the module docstring).

    ``await start()`` returns at once (etcd may be down: discovery keeps trying); await
    :meth:`wait_online` to know the card is published.  ``await close()`` (idempotent) revokes
    the lease, so the group forgets this agent at once, and stops every task; it leaves the
    agent and its peers alone.
    """

    def __init__(self, agent: Agent, config: DiscoveryConfig) -> None:
        if not config.etcd:
            raise ConfigError("discovery needs at least one etcd endpoint (discovery.etcd)")
        self.agent = agent
        self.config = config
        self._prefix = group_prefix(config.prefix, config.group)
        self._membership = Membership(agent.peer_id)
        self.ignored: dict[str, str] = {}
        """Cards that are not dialled, by peer id, with the reason (logged once)."""
        self._me: Card | None = None
        self._allowed: frozenset[str] | None = (
            frozenset(agent.config.curve_allowed_keys) if agent.config.curve_secret_key else None
        )
        self._online = asyncio.Event()
        self._closing = asyncio.Event()  # set by close(): wait_online() ends
        self._wake = asyncio.Event()
        self._stale: dict[str, int | None] = {}
        """Peers whose card vanished or changed: a dial of it in progress is cancelled.  Each →
        the handshake nonce of the incarnation joined when its card changed, which is removed
        (None: none, or the card vanished); a newer incarnation that joined meanwhile stays."""
        self._dialing: dict[str, asyncio.Task[None]] = {}
        self.dial_errors: dict[str, str] = {}
        """Peers whose last dial failed, by peer id, with the reason (logged once per reason)."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._client: Any = None
        self._lease: Any = None
        self._outage_logged = False
        self._started = self._closed = False

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> Self:
        """Publish and watch in the background (the agent must be started).  Returns self."""
        if self._closed:
            raise ClosedError("discovery is closed")
        if self._started:
            return self
        self._started = True
        agent = self.agent
        self._me = Card(
            peer_id=agent.peer_id, address=agent.control_address, fingerprint=agent.fingerprint,
            num_blocks=agent.region.num_blocks, block_len=agent.region.block_len,
            role=self.config.role, connect=self.config.connect,
        )
        agent.add_peer_listener(self._on_peer_event)
        self._spawn(self._run(), f"omni-discovery-{agent.peer_id}")
        self._spawn(self._reconcile_loop(), f"omni-discovery-dial-{agent.peer_id}")
        return self

    async def close(self) -> None:
        """Revoke the lease, close the etcd client, stop every task.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._online.clear()
        self._closing.set()
        tasks = [*self._tasks, *self._dialing.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        client, lease, self._client, self._lease = self._client, self._lease, None, None
        if lease is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(_CLOSE_S):
                    await lease.revoke()
        if client is not None:
            await _close_client(client)

    # -- what it knows ---------------------------------------------------------------------------
    @property
    def online(self) -> bool:
        """Whether the card is published and the group watched right now."""
        return self._online.is_set()

    @property
    def members(self) -> dict[str, Card]:
        """The group's other cards as last seen in etcd (kept while etcd is unreachable)."""
        return dict(self._membership.cards)

    async def wait_online(self, timeout: float | None = None) -> None:
        """Wait until the card is published and the group listed (TimeoutError after ``timeout``;
        :class:`ClosedError` once closed, also while it waits)."""
        if self._closed:
            raise ClosedError("discovery is closed")
        online = asyncio.ensure_future(self._online.wait())
        closed = asyncio.ensure_future(self._closing.wait())
        try:
            async with asyncio.timeout(timeout):
                await asyncio.wait((online, closed), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in (online, closed):
                waiter.cancel()
            await asyncio.gather(online, closed, return_exceptions=True)
        if not online.done() or online.cancelled():
            raise ClosedError("discovery closed while waiting to be online")

    # -- the etcd session ------------------------------------------------------------------------
    async def _run(self) -> None:
        """Sessions with etcd, one after another, across its endpoints, until closed."""
        attempt = 0
        while True:
            endpoint = self.config.etcd[attempt % len(self.config.etcd)]
            attempt += 1
            try:
                await self._session(endpoint)
            except Exception as exc:  # every failure of the client or etcd ends the session alike
                was_online = self.online
                self._online.clear()
                if was_online or not self._outage_logged:
                    log.warning("discovery: %s %s etcd at %s (%s); joined peers are kept, retrying every %ss",
                                self.agent.peer_id, "lost" if was_online else "cannot reach", endpoint, exc,
                                self.config.retry_interval)
                    self._outage_logged = True
            await asyncio.sleep(self.config.retry_interval)

    async def _session(self, endpoint: str) -> None:
        """Register, list, then keep the lease alive and follow the watch until one fails."""
        host, port = etcd_host_port(endpoint)
        rpc_timeout = max(1.0, self.config.ttl / 3)
        client = aetcd.Client(host=host, port=port, timeout=rpc_timeout)
        self._client = client
        try:
            assert self._me is not None
            lease = await client.lease(self.config.ttl)
            self._lease = lease
            key = card_key(self.config.prefix, self.config.group, self._me.peer_id).encode()
            await client.put(key, encode_card(self._me), lease=lease)
            listing = await client.get_prefix(self._prefix.encode())
            cards: dict[str, Card] = {}
            for kv in listing:
                card = self._decode(kv.key, kv.value)
                if card is not None:
                    cards[card.peer_id] = card
            self._apply(self._membership.snapshot(cards))
            watch = await client.watch_prefix(self._prefix.encode(), start_revision=listing.header.revision + 1)
            if self._outage_logged:
                log.warning("discovery: %s resumed with etcd at %s; %d other card(s)", self._me.peer_id, endpoint,
                            len(cards))
                self._outage_logged = False
            else:
                log.info("discovery: %s published in %s at %s; %d other card(s)",
                         self._me.peer_id, self._prefix, endpoint, len(cards))
            self._online.set()
            self._wake.set()
            await _first_failure(self._keep_alive(client, lease.id), self._follow(watch))
        except asyncio.CancelledError:
            raise  # close() revokes the lease and closes the client
        except BaseException:
            self._client = self._lease = None
            await _close_client(client)
            raise

    async def _keep_alive(self, client: Any, lease_id: int) -> None:
        """Refresh the lease every ``ttl / 3``; raises when etcd does not answer or the lease is gone."""
        while True:
            await asyncio.sleep(self.config.ttl / 3)
            reply = await client.refresh_lease(lease_id)
            if reply is None or reply.TTL <= 0:
                raise EtcdLost(f"lease {lease_id:x} expired")

    async def _follow(self, watch: Any) -> None:
        """Apply the group's changes as they come; raises when the stream ends."""
        async for event in watch:
            if event.kind == aetcd.EventKind.PUT:
                card = self._decode(event.kv.key, event.kv.value)
                if card is not None:
                    self._apply(self._membership.put(card))
            else:
                key = event.kv.key.decode(errors="replace")
                with contextlib.suppress(ProtocolError):  # not a card's key
                    self._apply(self._membership.delete(peer_id_of(key, self.config.prefix, self.config.group)))
        raise EtcdLost("the watch stream ended")

    def _decode(self, key: bytes, value: bytes) -> Card | None:
        """The card under ``key``, or None (logged once; a peer's unreadable card counts as gone)."""
        try:
            peer_id = peer_id_of(key.decode(errors="replace"), self.config.prefix, self.config.group)
        except ProtocolError:
            return None  # a key deeper under the group's prefix: not a card
        try:
            return decode_card(value, peer_id)
        except ProtocolError as exc:
            self._ignore(peer_id, f"unreadable card: {exc}")
            self._apply(self._membership.delete(peer_id))
            return None

    # -- acting on the group -----------------------------------------------------------------
    def _apply(self, changes: list[Change]) -> None:
        me = self._me
        assert me is not None
        for change in changes:
            peer_id, card = change.peer_id, change.card
            if change.kind == "changed":  # the agent moved or restarted: drop the incarnation joined now
                joined = self.agent.peers.get(peer_id)
                self._stale[peer_id] = None if joined is None else joined.nonce
            elif change.kind == "removed":  # stop dialling it (no evidence of death: keep a joined one)
                self._stale[peer_id] = None
            if card is None:  # not dialled again; a joined peer stays while it answers heartbeats
                log.info("discovery: %s's card vanished", peer_id)
                self.ignored.pop(peer_id, None)
                continue
            reason = incompatibility(me, card, self._allowed)
            if reason is None:
                self.ignored.pop(peer_id, None)
                log.info("discovery: %s found %s at %s", me.peer_id, peer_id, split_address(card.address)[0])
            else:
                self._ignore(peer_id, reason)
        self._wake.set()

    def _ignore(self, peer_id: str, reason: str) -> None:
        if self.ignored.get(peer_id) != reason:
            log.warning("discovery: ignoring %s: %s", peer_id, reason)
            self.ignored[peer_id] = reason

    def _on_peer_event(self, event: PeerEvent) -> None:
        if event.kind == "left" and not self._closed:
            self._wake.set()

    async def _reconcile_loop(self) -> None:
        """Remove peers whose card vanished or changed; dial wanted peers that are not joined.

        Runs on every change and every ``retry_interval`` (which retries failed dials)."""
        while True:
            self._wake.clear()
            try:
                await self._reconcile()
            except OmniAsyncError as exc:  # e.g. the agent was closed under us: try again later
                log.warning("discovery: %s could not act on the group: %s", self.agent.peer_id, exc)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.retry_interval):
                    await self._wake.wait()

    async def _reconcile(self) -> None:
        agent, me = self.agent, self._me
        assert me is not None
        stale, self._stale = self._stale, {}
        for peer_id, nonce in stale.items():
            task = self._dialing.pop(peer_id, None)
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            incarnation = agent.peers.get(peer_id)
            if incarnation is not None and incarnation.nonce == nonce:
                log.info("discovery: removing %s (its card changed)", peer_id)
                await agent.remove_peer(peer_id)
        if not self.online:
            return  # the cards may be stale: dial again once etcd answers
        joined = agent.peers
        for peer_id, card in self._membership.cards.items():
            if peer_id in joined or peer_id in self._dialing or peer_id in self.ignored:
                continue
            if should_dial(me, card):
                task = asyncio.get_running_loop().create_task(self.dial(card), name=f"omni-discovery-dial-{peer_id}")
                self._dialing[peer_id] = task
                task.add_done_callback(functools.partial(self._dial_done, peer_id))

    def _dial_done(self, peer_id: str, task: asyncio.Task[None]) -> None:
        if self._dialing.get(peer_id) is task:
            del self._dialing[peer_id]

    async def dial(self, card: Card) -> None:
        """Join ``card``'s agent, as discovery does for every card it should dial.  Never raises:
        a failure is recorded in :attr:`dial_errors` (logged once per peer and reason) and
        retried later; ``AlreadyConnected`` means the pair is joined and is no failure."""
        try:
            joined = await self.agent.connect(card.address)
        except AlreadyConnected:
            return  # its handshake joined the pair (the agent keeps one connection per pair)
        except Exception as exc:  # any failure of one dial is that peer's, retried later
            reason = f"{type(exc).__name__}: {exc}"
            if self.dial_errors.get(card.peer_id) != reason:
                log.warning("discovery: cannot join %s at %s: %s (retrying)", card.peer_id, card.address, reason)
                self.dial_errors[card.peer_id] = reason
            return
        self.dial_errors.pop(card.peer_id, None)
        if joined != card.peer_id:
            log.warning("discovery: %s answered as %s, not %s; leaving it", card.address, joined, card.peer_id)
            await self.agent.remove_peer(joined)
            return
        log.info("discovery: %s joined %s", self.agent.peer_id, joined)

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


async def _first_failure(*coros: Coroutine[Any, Any, None]) -> None:
    """Run ``coros`` together until the first one ends; cancel the others; re-raise its error."""
    tasks = [asyncio.ensure_future(coro) for coro in coros]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for task in done:
        task.result()


async def _close_client(client: Any) -> None:
    with contextlib.suppress(Exception):
        async with asyncio.timeout(_CLOSE_S):
            await client.close()
