"""The transport's peers: a lane opened, vetted and connected, the peer added (a same-host
ring and our remote keys offered, the peer's taken after vetting; a peer on this host asked
to prove which process it is before its region or ring is used, :mod:`.pid_proof`), removed
(its transfers failed, its rings, writer, proof and keys released) and its lane drained with a
goodbye, bounded by ``DRAIN_TIMEOUT``; the transport closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from functools import partial

from ..errors import (
    ClosedError,
    OmniAsyncError,
    PeerLost,
    ProtocolError,
)
from ..handshake import PeerInfo
from ..wire import (
    DATA_KIND,
    FULL_MASK,
    HEADER_TAG,
    KIND_MASK,
    Goodbye,
    ProofReady,
    ProofRequest,
    RingOffer,
    RkeyOffer,
    encode_header,
)
from .core import TransportCore, ignore
from .lane import Lane
from .limits import receive_budget
from .link import PeerLink, awaits_answer
from .pid_proof import holds_proof, make_proof, new_nonce, proof_name
from .pool import shared_pool_bytes
from .protocol import Deadlines
from .rma import Registration
from .samehost import LINGER, RingReceiver, RingSender
from .shared import Refused, open_writers, share_pids
from .vetting import NotVetted

log = logging.getLogger(__name__)

DRAIN_TIMEOUT = 1.0
"""Seconds an orderly lane close waits for the peer's Goodbye and pending requests."""


class Peers(TransportCore):
    """The peer methods of :class:`~.ucx.UcxTransport` (adding, removing, draining, closing)."""

    async def warm_up(self) -> None:
        """Start the address-vetting child now (about half a second, once per process) rather
        than inside the first handshake, whose timeout it would eat into."""
        await asyncio.get_running_loop().run_in_executor(None, self._vetter.warm_up)

    def open_lane(self) -> Lane:
        """A fresh lane whose address goes into a handshake; pass it to :meth:`add_peer`."""
        self._check_open()
        return Lane(self._context, self._loop, close_grace=self.config.lane_close_grace)

    async def connect_lane(self, peer: PeerInfo, lane: Lane) -> None:
        """Connect ``lane`` to the peer's lane (the first half of adding a peer; :meth:`add_peer`
        is the second).  The peer's address is vetted first (see :mod:`.vetting`); an unusable
        one raises :class:`ProtocolError`.  Nothing is added: on failure discard the lane."""
        self._check_open()
        lane.check_address(peer.agent_metadata)  # cheap structural check first
        await self._vetter.check(peer.agent_metadata)
        lane.connect(peer.agent_metadata)
        self._check_open()

    def add_peer(self, peer: PeerInfo, lane: Lane) -> None:
        """Start sending to and receiving from the peer over ``lane`` (connected by
        :meth:`connect_lane`).  The owner removed any previous link of the peer id first."""
        self._check_open()
        if peer.peer_id in self._links:
            raise RuntimeError(f"peer {peer.peer_id!r} still has a lane")  # the owner's bug
        link = PeerLink(
            peer,
            lane,
            Deadlines(self.config.transfer_timeout),
            gather=peer.host_id == self.host_id and self.config.ucx_tls != "tcp",
            receive_bytes=receive_budget(self.config.max_message_bytes),
        )
        self._links[peer.peer_id] = link
        lane.watch(HEADER_TAG, FULL_MASK, partial(self._header_arrived, link))
        lane.watch(DATA_KIND, KIND_MASK, partial(self._data_arrived, link))
        lane.on_stray = partial(self._stray_arrived, link)
        # Acknowledgements come through the ring once there is one: the lane need not spin.
        lane.expecting = lambda: (bool(link.sent) and link.ring_out is None) or link.inbox.expecting
        # Not once removed: a draining lane has no rings left, yet nothing to stay hot for.
        lane.stay_hot = lambda: link.ring_out is None and link.ring_in is None and self._links.get(peer.peer_id) is link
        if self.config.same_host_lane and self.host_id and peer.host_id == self.host_id:
            self._challenge(link)  # its region and its ring are used once it proved its process
        self._offer_ring(link)
        self._offer_keys(link)

    def _challenge(self, link: PeerLink) -> None:
        """Ask a peer on this host which process it is (see :mod:`.pid_proof`)."""
        nonce = new_nonce()
        link.proof = proof_name(nonce, self.peer_id)
        link.proving = self._loop.create_future()
        link.lane.send(encode_header(ProofRequest(nonce)), HEADER_TAG, ignore)

    async def same_host_settled(self, peer_id: str, timeout: float) -> None:
        """Wait until a peer on this host answered our proof request (see :mod:`.pid_proof`),
        so that writes to it take the same-host lane from now on if its process proved it
        offers its own region; at most ``timeout`` seconds (then they stay on UCX until it
        answers).  A link that replaced the peer's meanwhile (a crossing handshake) is waited
        for too.  Returns at once for any other peer, or one no longer joined."""
        deadline = self._loop.time() + timeout
        while (link := self._links.get(peer_id)) is not None and link.proving is not None:
            left = deadline - self._loop.time()
            if link.proving.done() or left <= 0:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(link.proving), left)

    def _first(self, link: PeerLink, flag: str, what: str) -> bool:
        """Whether to take the peer's ``what``, of which a link takes one (``flag``: the link's
        attribute saying it came): not on a removed or replaced link; a second breaks the
        protocol (the peer is dropped)."""
        if self._links.get(link.peer.peer_id) is not link:
            return False
        if getattr(link, flag):
            self._drop(link, ProtocolError(f"a second {what}"))
            return False
        setattr(link, flag, True)
        return True

    def _on_proof_request(self, link: PeerLink, request: ProofRequest) -> None:
        """The peer asks which process we are: hold the proof its nonce names for it, and say
        so (also if it could not be made: the peer then finds none, at once, rather than
        waiting for an answer).  A link takes one request: a second breaks the protocol (the
        peer is dropped)."""
        if not self._first(link, "proof_asked", "proof request"):
            return
        try:
            link.proof_fd = make_proof(request.nonce, link.peer.peer_id)
        except OSError as exc:  # answered all the same: the peer finds no proof and keeps to UCX
            log.warning("cannot prove this process to %s: %s", link.peer.peer_id, exc)
        link.lane.send(encode_header(ProofReady(request.nonce, link.proof_fd)), HEADER_TAG, ignore)

    def _on_proof_ready(self, link: PeerLink, ready: ProofReady) -> None:
        """The peer holds the proof we asked for: write its region directly, and send through
        its ring, only where the process they name holds it (else they are another process's:
        logged, and the link stays on UCX).  One that answers no request of ours, or a second
        one, breaks the protocol."""
        if self._links.get(link.peer.peer_id) is not link:
            return
        if not link.proof or link.proven or proof_name(ready.nonce, self.peer_id) != link.proof:
            self._drop(link, ProtocolError("a proof that answers no request of ours"))
            return
        link.proof_at = ready.fd
        _settle_proving(link)  # (proven from now on)
        pids = share_pids(link.peer)
        if pids and all(holds_proof(pid, ready.fd, link.proof) for pid in pids):
            link.direct = open_writers(link.peer, self.host_id)
        elif pids:
            log.warning("peer %s offered the region of process %s, which is not the peer: its writes go through UCX",
                        link.peer.peer_id, sorted(pids))
        offer, link.ring_offer = link.ring_offer, None
        if offer is not None:
            self._map_ring(link, offer)

    def _offer_ring(self, link: PeerLink) -> None:
        """Offer a peer on this host a ring for what it sends us (see :mod:`.samehost`)."""
        if not (self.config.same_host_lane and self.host_id and link.peer.host_id == self.host_id):
            return
        try:
            ring = RingReceiver(
                self._loop,
                partial(self._ring_record, link),
                partial(self._ring_broke, link),
                partial(awaits_answer, link),
                batch_done=partial(self._flush_acks, link),
                pool_bytes=shared_pool_bytes(self.config.shared_pool_mib),
                handoffs=self._handoffs,
            )
        except OSError as exc:
            log.warning("no same-host ring for %s: %s", link.peer.peer_id, exc)
            return
        link.ring_in = ring
        link.lane.send(encode_header(ring.offer()), HEADER_TAG, ignore)

    def _on_ring_offer(self, link: PeerLink, offer: RingOffer) -> None:
        """The peer offers its ring: send through it from now on, if it can be mapped.  A link
        takes one offer: a second breaks the protocol (the peer is dropped).  One that cannot be
        mapped (a peer in another mount namespace offers such in good faith), or that comes on
        a link that is no same-host one here, is logged and the link stays on UCX.  Nothing on a
        removed peer's draining lane (its rings are gone)."""
        if not self._first(link, "ring_offered", "ring offer"):
            return
        if link.ring_in is None:
            log.warning("ignored a ring offer from %s (not a same-host link here)", link.peer.peer_id)
            return
        if link.proven:
            self._map_ring(link, offer)
        else:
            link.ring_offer = offer  # mapped once the peer proved its process

    def _map_ring(self, link: PeerLink, offer: RingOffer) -> None:
        """Send through the peer's ring from now on, if it is the proven process's and can be
        mapped (else the link stays on UCX, logged).  Not once our own ring is gone (it broke)."""
        if link.ring_in is None:
            return
        if not holds_proof(offer.pid, link.proof_at, link.proof):
            log.warning("peer %s offered the ring of process %d, which is not the peer: headers go through UCX",
                        link.peer.peer_id, offer.pid)
            return
        try:
            link.ring_out = RingSender(offer)
        except (Refused, OSError, ValueError) as exc:
            log.warning("peer %s: no same-host ring, headers go through UCX (%s)", link.peer.peer_id, exc)
            return
        if not link.ring_out.in_this_process:  # its next record may come while we poll
            link.ring_in.linger = LINGER
        link.ring_in.answers_from(link.ring_out, partial(self._answered, link))

    def _offer_keys(self, link: PeerLink) -> None:
        """Offer a peer without a same-host lane puts into our regions (mapped on first use)."""
        if not self.config.ucx_puts or link.gather:
            return
        if self._registration is None:
            try:
                self._registration = Registration(self._context, self._arrays)
            except OSError as exc:
                log.warning("regions not mapped for UCX puts, writes to us go as tag messages: %s", exc)
                return
        link.lane.send(encode_header(RkeyOffer(list(self._registration.keys))), HEADER_TAG, ignore)

    def _on_rkey_offer(self, link: PeerLink, offer: RkeyOffer) -> None:
        """The peer offers puts into its regions: vet its keys in a child, then unpack them.
        Not on a removed peer's draining lane (nothing will write to it; the vetting task would
        outlive the transport's close)."""
        if not self.config.ucx_puts:
            return  # puts are off here: writes to the peer go as tag messages
        if self._closed or self._links.get(link.peer.peer_id) is not link:
            return
        if link.gather or link.remote_keys is not None or link.keying is not None:
            log.warning("ignored a remote key offer from %s (a same-host link, or a second one)", link.peer.peer_id)
            return
        if len(offer.keys) != len(self._arrays):
            self._drop(link, ProtocolError(f"{len(offer.keys)} remote keys offered for {len(self._arrays)} regions"))
            return
        link.keying = self._loop.create_task(self._take_keys(link, offer.keys), name=f"omni-rkeys-{link.peer.peer_id}")

    async def _take_keys(self, link: PeerLink, keys: list[bytes]) -> None:
        """Vet the peer's offered keys in a child, then unpack them on its lane: from then on
        writes to it go as puts.  Keys UCX refuses drop the peer; a check with no verdict (the
        vetter is saturated or slow) leaves it on tag messages."""
        try:
            await self._vetter.check(link.peer.agent_metadata, keys=keys)
            if self._links.get(link.peer.peer_id) is link:
                link.remote_keys = link.lane.unpack_keys(keys)
        except NotVetted as exc:
            log.warning("peer %s: writes go as tag messages: %s", link.peer.peer_id, exc)
        except ProtocolError as exc:
            log.warning("peer %s: %s", link.peer.peer_id, exc)
            self._drop(link, exc)
        except PeerLost:
            pass  # the lane closed meanwhile
        except OSError as exc:  # the vetting child could not be run: no puts to this peer
            log.warning("peer %s: remote keys not vetted, writes go as tag messages: %s", link.peer.peer_id, exc)
        finally:
            link.keying = None

    def remove_peer(self, peer_id: str, error: OmniAsyncError | None = None, *, orderly: bool = False) -> bool:
        """Fail the peer's in-flight transfers with ``error`` and close its lane.

        ``orderly`` (the peer is alive: it said goodbye, or this side is closing or removing it)
        drains the lane first: both sides send a :class:`~omni_async.wire.Goodbye` and close
        once they have the other's and nothing is pending, so no UCX request is left behind
        (a send to a peer that stopped progressing could never complete, and would pin the
        lane's worker).  Draining is bounded by ``DRAIN_TIMEOUT``.  Returns False if unknown.
        """
        link = self._links.pop(peer_id, None)
        if link is None:
            return False
        if link.ring_in is not None:
            # What the peer put into its ring before it was lost counts (an intent above all:
            # its rows may be changing); acknowledgements settle, nothing is answered.
            link.ring_in.drain()
        self._count_tail_acked(link)  # (removed within a ring batch: its end will not come)
        error = error or PeerLost(f"peer {peer_id!r} removed")
        for notice in link.notices.lost(error):  # the writes it was sending us fail
            self.notices.offer(notice, _nothing)
        link.outbox.clear()
        link.parked.clear()
        link.held.clear()
        link.intents.clear()
        link.remote_keys = None  # the lane owns them: destroyed before its worker
        if link.keying is not None:
            link.keying.cancel()
            self._keyings.add(link.keying)
            link.keying.add_done_callback(self._keyings.discard)
        self._drop_direct(link)
        self._drop_rings(link)
        if link.proof_fd >= 0:
            os.close(link.proof_fd)
            link.proof_fd = -1
        _settle_proving(link)
        if link.timer is not None:
            link.timer.cancel()
            link.timer = None
        if orderly:
            link.drain.leave()
            link.lane.send(encode_header(Goodbye()), HEADER_TAG, ignore)
            task = self._loop.create_task(self._drain_lane(link, error), name=f"omni-drain-{peer_id}")
            self._drains.add(task)
            task.add_done_callback(self._drains.discard)
        else:
            self._fail_sent(link, error)
            self._release_link(link, error)
        return True

    def _fail_sent(self, link: PeerLink, error: OmniAsyncError) -> None:
        """Fail the removed peer's transfers still in flight with ``error``."""
        for transfer_id in list(link.sent):
            self._settle(link, transfer_id, error)

    def _release_link(self, link: PeerLink, error: OmniAsyncError) -> None:
        """Let go of everything a removed peer owned: payload messages whose header never came
        are taken (truncated into scratch), so UCX is not left holding probed messages nobody
        received; the buffers announced for it are dropped; its lane closes."""
        for message in link.inbox.release():
            link.lane.recv_arrived_many([link.scratch], message, ignore)
        self.discard_lane(link.lane, error)

    async def _drain_lane(self, link: PeerLink, error: OmniAsyncError) -> None:
        """Release the lane once the lane protocol says it drained (:class:`.protocol.Drain`:
        the peer's Goodbye is here and nothing is pending), or after ``DRAIN_TIMEOUT``.
        Event-driven: the lane reports each progress pass; nothing polls.  The transfers still
        in flight fail only then, once the lane no longer reads their rows (its posted sends
        completed, or it closed): their owners may reuse the rows once told (they were failed
        at once, while the drain still sent their bytes)."""
        lane = link.lane
        drained = self._loop.create_future()

        def progress() -> None:
            if link.drain.progress(lane.in_flight):
                drained.set_result(None)

        lane.on_progress = progress
        try:
            progress()  # the peer may have left already, and the Goodbye be sent
            async with asyncio.timeout(DRAIN_TIMEOUT):
                await drained
        except TimeoutError:
            if link.drain.expire():
                log.info("lane to %s closed before it drained (%.1fs)", link.peer.peer_id, DRAIN_TIMEOUT)
        finally:
            lane.on_progress = None
            self._release_link(link, error)
            try:
                await lane.wait_closed()  # (puts posted still read the rows until it closed)
            finally:
                self._fail_sent(link, error)

    def discard_lane(self, lane: Lane, error: BaseException | None = None) -> None:
        """Close a lane (of a removed peer, or of a failed handshake); :meth:`close` waits for it."""
        lane.close(error)
        self._closing = {other for other in self._closing if not other.released}
        self._closing.add(lane)

    async def close(self) -> None:
        """Fail every in-flight transfer with :class:`ClosedError`, drain and close all lanes
        and wait until UCX released them.  Idempotent."""
        if not self._closed:
            self._closed = True
            for peer_id in list(self._links):
                self.remove_peer(peer_id, ClosedError("transport closed"), orderly=True)
            self.notices.close()
        await asyncio.gather(*list(self._drains))
        await asyncio.gather(*(lane.wait_closed() for lane in list(self._closing)))
        if self._keyings:
            await asyncio.wait(list(self._keyings))
        await self.sink_tasks.close()  # what the application's async sinks still await
        registration, self._registration = self._registration, None
        if registration is not None:  # no lane is left to put into the regions
            registration.close()


def _nothing() -> None:
    """Release of a notice with no acknowledgement held (its sender is gone)."""


def _settle_proving(link: PeerLink) -> None:
    """The wait for the peer's proof ends (it answered, or the link ended)."""
    if link.proving is not None and not link.proving.done():
        link.proving.set_result(None)
