"""Block writes and reads, the sending side: a write's runs split into requests within the
receiver's limits, each copied straight into a same-host peer's rows (told with a ``placed``
header, announced with an intent when large or noticed), put into its registered memory
(:mod:`.rma`), or sent as tag messages; requests with a notice kept in write order.  A read
asks the peer to write into our rows, or copies a mapped peer's rows here.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from ..errors import (
    InvalidBlocks,
    PeerLost,
    ReadsNotAllowed,
    TransferFailed,
    TransferRefused,
)
from ..region import Run, plan_runs
from ..wire import (
    HEADER_TAG,
    MAX_PENDING_PAYLOADS,
    READ_RUNS_PER_REQUEST,
    RUNS_PER_REQUEST,
    Commit,
    ReadRequest,
    WriteRequest,
    data_tag,
    encode_header,
    encode_record,
)
from .core import TransportCore, carry_out
from .iov import iov_of_runs
from .limits import check_notice, check_notice_runs, split_runs
from .link import PeerLink
from .ring import RingError
from .rma import puts_of_runs
from .samehost import KIND_HEADER
from .transfer import Transfer

log = logging.getLogger(__name__)

_GATHER_MAX_RUN = 256 * 1024
"""Writes whose runs average less than this many bytes are gathered into one message."""
PUT_MIN_BYTES = 64 * 1024
"""A write request of one payload message up to this size goes as a tag message even where
puts are on (one round trip; a put and its flush take two)."""
MAX_SERVED_READS = 1024
"""Read requests of one peer this side serves at once (each is a write to it, waiting in its
window if need be); more are refused with :class:`~omni_async.errors.TransferRefused`, so a
peer cannot make this side hold an unbounded queue of writes.  A request (a few bytes, up to
2,048 runs) asking for more blocks than the peer's region has rows is refused too
(:class:`~omni_async.errors.InvalidBlocks`): what one request makes this side send is at most
the peer's region."""
ANNOUNCE_BYTES = 1 << 20
"""A same-host write request (no notice) of at least this many bytes is announced with an
intent before its copy (some 100 µs or more): the receiver checks it and stays awake for its
commit meanwhile, instead of sleeping until a wake-up after the copy.  Smaller ones are
copied, then told (their copy is shorter than a wake-up)."""


class BlockWrites(TransportCore):
    """The block-write and read methods of :class:`~.ucx.UcxTransport` (sending side)."""

    def write_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int], *, notice: bytes | None = None
    ) -> Transfer:
        """Write local blocks into the peer's blocks; the returned transfer settles on its ack.

        Raises at once, before any byte moves: :class:`UnknownPeer`, :class:`InvalidBlocks`
        (unequal lengths, an index out of range or not an int, a write with a notice of more than
        :data:`~omni_async.wire.MAX_NOTICE_RUNS` runs), :class:`InvalidNotice` (a
        ``notice`` over the peer's ``max_notice_bytes``), :class:`TypeError` (a notice that is
        not bytes), :class:`ClosedError`.
        A write larger than the receiver takes in one request goes out as several.
        The local blocks must not change until the transfer settles.

        With ``notice`` the peer's application gets a :class:`~.notices.Notice` with this data
        once every row is in place, before the transfer settles (one per write, however it is
        split); if the write fails or is given up after some of it was sent, a failed one.
        A write of no blocks sends nothing and notifies nobody.
        """
        self._check_open()
        link = self._link(peer_id)
        if notice is None and len(local_idxs) == 1 and len(remote_idxs) == 1:
            transfer = self._place_row(link, local_idxs[0], remote_idxs[0])
            if transfer is not None:
                return transfer
        if notice is not None:
            notice = check_notice(notice, link.peer.max_notice_bytes)
        runs = plan_runs(local_idxs, remote_idxs, self.num_blocks, link.peer.num_blocks)
        if notice is not None:
            check_notice_runs(runs, len(local_idxs), link.peer.max_write_blocks)
        return self._write_runs(link, runs, len(local_idxs), notice)

    def _place_row(self, link: PeerLink, local: object, remote: object) -> Transfer | None:
        """The common small write, one block (``local`` -> ``remote``, as given) to a peer on this
        host: copied straight into its row, then told with a ``placed`` header, as
        :meth:`_write_runs` does it, without the planning and the request machinery it needs
        for every other write (one Python step in place of a dozen: row a).  None if the write
        is not that (an index that is not an in-range ``int``, no same-host writer, a block
        too large to copy unannounced, requests waiting for the window): the caller takes the
        general path, which also raises what a bad index deserves.

        The header goes into the peer's ring before the transfer is registered here, so that
        the peer handles it while we do (its answer is taken by this thread only, later); what
        could settle the transfer before (a failed copy, a ring the peer corrupted, a ring
        whose wake-up failed) is acted on only once it is registered."""
        direct = link.direct
        if (
            direct is None
            or type(local) is not int
            or type(remote) is not int
            or not 0 <= local < self.num_blocks
            or not 0 <= remote < link.peer.num_blocks
            or remote >= direct.num_blocks
            or self.regions.block_bytes >= ANNOUNCE_BYTES
            or not link.outbox.idle
        ):
            return None
        transfer_id = next(self._ids)
        nbytes = self.regions.block_bytes
        try:
            direct.place(self._arrays, [(local, remote, 1)])
        except OSError as exc:  # nothing was sent
            transfer = self._new_transfer(link, nbytes, "blocks", transfer_id)
            self._copy_failed(link, transfer_id, exc)
            return transfer
        tail = _answered_by_consumption(link)
        header = WriteRequest(transfer_id, link.outbox.take_seq(0), [(remote, 1)], placed=True, tail=tail)
        tail_of = transfer_id if tail else None
        ring, broke, into_ring = link.ring_out, None, False
        if ring is not None:
            try:
                into_ring = ring.send(KIND_HEADER, (encode_record(header),), tail_of)
            except RingError as exc:
                broke = exc
        transfer = self._new_transfer(link, nbytes, "blocks", transfer_id)
        link.outbox.start(transfer_id)
        if broke is not None:
            self._drop(link, broke)  # (the peer's removal fails the transfer)
        elif ring is None or not into_ring:  # no ring, or no room in it (now there may be): as any header
            self._tell_placed(link, header)
        else:
            self._ring_sent(link, ring, True)
            if tail:
                self._answer_tail_in_awaiter(link, transfer_id)
        return transfer

    def write_runs(self, peer_id: str, runs: list[Run], blocks: int, *, remote_blocks: int) -> Transfer:
        """:meth:`write_blocks` of a plan made already: ``runs`` from
        :func:`~omni_async.region.plan_runs` over ``blocks`` index pairs, checked against this
        region and a peer of ``remote_blocks`` blocks (the sync facade plans in its caller's
        thread, to refuse bad indices there, and hands the plan over: one plan per write).

        Raises :class:`InvalidBlocks` if the peer's region no longer has ``remote_blocks``
        blocks (it rejoined with another layout), and what :meth:`write_blocks` raises."""
        self._check_open()
        link = self._link(peer_id)
        if link.peer.num_blocks != remote_blocks:
            raise InvalidBlocks(
                f"planned for a peer of {remote_blocks} blocks; peer {peer_id!r} now has {link.peer.num_blocks}"
            )
        if blocks == 1 and len(runs) == 1:
            transfer = self._place_row(link, runs[0][0], runs[0][1])
            if transfer is not None:
                return transfer
        return self._write_runs(link, runs, blocks, None)

    def _write_runs(self, link: PeerLink, runs: list[Run], blocks: int, notice: bytes | None) -> Transfer:
        """Write checked runs (``local``: our rows, ``remote``: the peer's) to the peer."""
        block_bytes = self.regions.block_bytes
        layers = len(self._arrays)
        transfer = self._new_transfer(link, blocks * block_bytes, "blocks")
        if not runs:
            self._settle(link, transfer.id, None)  # nothing to move: done, and not left in flight
            return transfer
        # More runs or blocks than one request may carry (the receiver's limits): several
        # requests under the same transfer id, settled by the last acknowledgement.
        direct = link.direct
        placed = direct is not None and (
            direct.num_blocks >= link.peer.num_blocks  # the runs are bounded by the peer's layout
            or max(remote + length for _local, remote, length in runs) <= direct.num_blocks
        )
        # A write with a notice is placed only behind an intent in the peer's ring (see _place_announced).
        placed = placed and (notice is None or link.ring_out is not None)
        # Puts: a write without a notice to a peer that offered its keys (tcp, other hosts).
        put = direct is None and notice is None and link.remote_keys is not None
        # A run is one payload message per region unless gathered: keep a request within the
        # receiver's bound on payload messages pending.
        max_runs = min(RUNS_PER_REQUEST, MAX_PENDING_PAYLOADS // layers)
        if (
            placed
            and notice is None
            and blocks * block_bytes < ANNOUNCE_BYTES
            and blocks <= link.peer.max_write_blocks
            and len(runs) <= max_runs
        ):  # the common small write: one placed request, copied then told (as the loop below makes it)
            carry_out(link.outbox.submit(transfer.id, [(0, 0, partial(self._place, link, transfer.id, runs, True))]))
            return transfer
        requests: list[tuple[int, int, Callable[[], None]]] = []
        split = split_runs(runs, link.peer.max_write_blocks, max_runs, blocks)
        announced = False
        for part, request in enumerate(split):
            tag = None if notice is None else _Tag(notice, part, len(split))
            if placed:  # same host: copied straight into the peer's rows, no payload message
                # An intent counts as a payload message: the receiver's bound on intents
                # pending is the window's.
                if tag is not None:
                    place = partial(self._place_announced, link, transfer.id, request, tag, part)
                    requests.append((1, 0, partial(self._gate, link, transfer.id, True, place)))
                elif (
                    link.ring_out is not None
                    and _request_blocks(request, blocks, len(split)) * block_bytes >= ANNOUNCE_BYTES
                ):
                    announced = True
                    announce = partial(self._place_announced, link, transfer.id, request, None, part, len(split))
                    requests.append((1, 0, announce))
                else:
                    requests.append((0, 0, partial(self._place, link, transfer.id, request)))
                continue
            nbytes = sum(run[2] for run in request) * block_bytes
            messages = len(request) * layers
            # One eager message (up to a 64 KiB block) goes faster as a tag: puts need a flush,
            # one more round trip (measured, docs/tuning.md).
            if put and (messages > 1 or nbytes > PUT_MIN_BYTES):
                requests.append((0, 0, partial(self._put_write, link, transfer.id, request)))
                continue
            # Many small runs: one gathered message (Python cost per message dominates).  Large
            # runs: one message each, which UCX pipelines better (measured, docs/tuning.md).
            gather = link.gather and messages > 1 and nbytes < _GATHER_MAX_RUN * messages
            post = partial(self._post_write, link, transfer.id, request, gather, tag)
            if tag is not None:
                post = partial(self._gate, link, transfer.id, False, post)
            requests.append((1 if gather else messages, 0, post))
        # An announced write given up is aborted, as one with a notice: its intents fail.  Each
        # request is carried out only while the transfer is live (see _if_live).
        live: list[tuple[int, int, Callable[[], None]]] = [
            (count, size, partial(self._if_live, link, transfer.id, post)) for count, size, post in requests
        ]
        carry_out(link.outbox.submit(transfer.id, live, abortable=notice is not None or announced))
        return transfer

    def read_blocks(self, peer_id: str, remote_idxs: Sequence[int], local_idxs: Sequence[int]) -> Transfer:
        """Copy the peer's blocks ``remote_idxs`` into ours ``local_idxs``; the returned
        transfer settles once every row is in place (or fails, and says why).

        Raises at once, before any I/O: :class:`ReadsNotAllowed` (the peer's ``allow_reads``
        is off), :class:`UnknownPeer`, :class:`InvalidBlocks` (also for more indices than
        our region has rows: some would be written twice), :class:`ClosedError`.  Fails
        with :class:`~omni_async.errors.TransferRefused` if the peer serves
        :data:`MAX_SERVED_READS` read requests of ours already (a read of more than 2,048 runs
        is several requests).  A peer
        on this host whose region is mapped here is copied from directly (settled on return);
        otherwise a :class:`~omni_async.wire.ReadRequest` asks the peer to write the rows
        into ours.  Deadlines, cancel modes and peer loss as for writes; after
        ``cancel("immediate")`` the peer may still write the requested rows for a moment,
        and no other row of ours is ever written.
        """
        self._check_open()
        link = self._link(peer_id)
        if not link.peer.allow_reads:
            raise ReadsNotAllowed(f"peer {peer_id!r} does not allow reads of its region")
        if len(local_idxs) > self.num_blocks:
            raise InvalidBlocks(f"a read of {len(local_idxs)} blocks into a region of {self.num_blocks}")
        runs = plan_runs(local_idxs, remote_idxs, self.num_blocks, link.peer.num_blocks)
        transfer = self._new_transfer(link, len(local_idxs) * self.regions.block_bytes, "blocks")
        direct = link.direct
        if not runs:
            self._settle(link, transfer.id, None)
            return transfer
        if direct is not None and direct.mapped and max(r + n for _l, r, n in runs) <= direct.num_blocks:
            try:
                direct.fetch(self._arrays, runs)
            except OSError as exc:  # unmapped meanwhile: cannot happen on the loop, but say why
                self._settle(link, transfer.id, TransferFailed(f"same-host read failed: {exc}"))
            else:
                self._settle(link, transfer.id, None)
            return transfer
        requests: list[tuple[int, int, Callable[[], None]]] = []
        for first in range(0, len(runs), READ_RUNS_PER_REQUEST):
            pairs = [(remote, local, length) for local, remote, length in runs[first : first + READ_RUNS_PER_REQUEST]]
            header = encode_header(ReadRequest(transfer.id, pairs))
            requests.append((0, 0, partial(link.lane.send, header, HEADER_TAG, partial(self._sent, link, transfer.id))))
        carry_out(link.outbox.submit(transfer.id, requests))
        return transfer

    def _on_read(self, link: PeerLink, req: ReadRequest) -> None:
        """A peer asks for our rows: write them into its region, then acknowledge the read
        once that write is acknowledged (or refuse it, with the reason)."""
        if self._closed or self._links.get(link.peer.peer_id) is not link:
            return  # leaving: no new writes to it
        block_bytes = self.regions.block_bytes
        refuse = partial(self._answer, link, req.transfer_id, "blocks", 0)
        if not self.config.allow_reads:
            log.warning("refused read %d from %s: reads are not allowed", req.transfer_id, link.peer.peer_id)
            refuse(ReadsNotAllowed("this peer does not allow reads of its region"))
            return
        if link.reads_served >= MAX_SERVED_READS:
            _refuse_read(link, refuse, TransferRefused(f"{MAX_SERVED_READS} read requests of it are being served"))
            return
        runs: list[Run] = [(src, dst, count) for src, dst, count in req.runs]
        for src, dst, count in runs:
            if src + count > self.num_blocks or dst + count > link.peer.num_blocks:
                refuse(InvalidBlocks(f"read of {count} blocks from {src} into {dst} leaves a region"))
                return
        blocks = sum(run[2] for run in runs)
        if blocks > link.peer.num_blocks:  # rows written more than once: no read of ours asks that
            error = InvalidBlocks(f"read of {blocks} blocks into a region of {link.peer.num_blocks}")
            _refuse_read(link, refuse, error)
            return
        link.reads_served += 1
        write = self._write_runs(link, runs, blocks, None)
        answer = partial(self._answer, link, req.transfer_id, "blocks", blocks * block_bytes)
        write.add_done_callback(partial(self._served, link, answer))

    @staticmethod
    def _served(link: PeerLink, answer: Callable[[BaseException | None], None], write: Transfer) -> None:
        """The write that serves a peer's read request settled: answer the read."""
        link.reads_served -= 1
        answer(write.error())

    def _post_write(self, link: PeerLink, transfer_id: int, runs: list[Run], gather: bool, tag: _Tag | None) -> None:
        """Send one write request (within the receiver's limits) and its payload."""
        seq = link.outbox.take_seq(1 if gather else len(runs) * len(self._arrays))
        header = _write_request(transfer_id, seq, runs, tag, gathered=gather)
        if tag is not None:
            self._count_noticed(link, transfer_id, lane=True)
        on_sent = partial(self._sent, link, transfer_id)
        lane = link.lane
        lane.send(encode_header(header), HEADER_TAG, on_sent)
        if gather:  # one message, gathered from the rows (two or more: see _write_runs)
            lane.send_iov(iov_of_runs(self._arrays, runs), self._arrays, data_tag(seq), on_sent)
        else:
            for i, row in enumerate(self._rows([(local, length) for local, _remote, length in runs])):
                lane.send(row, data_tag(seq + i), on_sent)

    def _put_write(self, link: PeerLink, transfer_id: int, runs: list[Run]) -> None:
        """Put one write request's rows into the peer's region (one put per run and region,
        inside the region the peer announced: ``plan_runs`` checked the indices) and flush.
        Its ``placed`` header goes first, so that the peer checks the runs and answers while
        the bytes travel; the answer counts only once the flush completed (every byte is in
        the peer's memory: see :meth:`_answered`), so the request ends on whichever comes
        last, one round trip in all.  A failed put or flush (the peer died) fails the
        transfer with :class:`PeerLost` and drops the peer."""
        keys = link.remote_keys
        if keys is None:  # the peer was removed while this waited for its window
            self._settle(link, transfer_id, PeerLost(f"peer {link.peer.peer_id!r} removed"))
            return
        peer = link.peer
        bases = (peer.base_addr, *(layer.base_addr for layer in peer.layers))
        puts = puts_of_runs(self._arrays, runs, bases, keys)
        link.flushing[transfer_id] = link.flushing.get(transfer_id, 0) + 1
        header = _write_request(transfer_id, link.outbox.take_seq(0), runs, None, placed=True)
        self._send_header(link, header, transfer_id)
        link.lane.put(puts, self._arrays, partial(self._flushed, link, transfer_id))

    def _flushed(self, link: PeerLink, transfer_id: int, error: BaseException | None) -> None:
        """A put request's flush completed: once none of the transfer's is pending, the
        answers the peer gave meanwhile count (a failed flush fails the transfer instead)."""
        pending = link.flushing.get(transfer_id, 1) - 1
        if pending:
            link.flushing[transfer_id] = pending
        else:
            link.flushing.pop(transfer_id, None)
        if error is not None:
            link.early_answers.pop(transfer_id, None)
            self._sent(link, transfer_id, error)
            return
        if not pending:
            for code, reason in link.early_answers.pop(transfer_id, ()):
                self._answered(link, transfer_id, code, reason)

    def _place(self, link: PeerLink, transfer_id: int, runs: list[Run], alone: bool = False) -> None:
        """Copy the runs straight into the peer's region, then tell it with a ``placed`` header
        (a write without a notice: nobody but the sender awaits it); ``alone``: the transfer's
        only request, which the peer's consumption of its ring record may answer (``tail``:
        see :class:`~omni_async.wire.WriteRequest`).  If the copy fails nothing is sent, so no answer will come: the
        request's window share is withdrawn here."""
        if self._copy(link, transfer_id, runs):
            tail = alone and _answered_by_consumption(link)
            header = _write_request(transfer_id, link.outbox.take_seq(0), runs, None, placed=True, tail=tail)
            self._tell_placed(link, header)
        else:
            carry_out(link.outbox.withdraw(transfer_id))

    def _tell_placed(self, link: PeerLink, header: WriteRequest) -> None:
        """Send the header of a request copied into the peer's rows (see
        :meth:`_answer_tail_in_awaiter` for one the peer's consumption answers)."""
        transfer_id = header.transfer_id
        tail_of = transfer_id if header.tail else None
        if self._send_header(link, header, transfer_id, tail_of) and header.tail:
            self._answer_tail_in_awaiter(link, transfer_id)

    def _answer_tail_in_awaiter(self, link: PeerLink, transfer_id: int) -> None:
        """A placed header the peer's consumption of its ring record answers (``tail``) is in
        the ring: the transfer's awaiter takes that answer
        (:meth:`~.transfer.Transfer.answer_in_awaiter`), unless the peer runs in this process
        (it cannot answer while the awaiter polls) or the transfer settled meanwhile (a ring
        that broke on the put)."""
        ring, transfer = link.ring_out, link.sent.get(transfer_id)
        if ring is not None and not ring.in_this_process and transfer is not None:
            transfer.answer_in_awaiter(self._answer_in_awaiter)

    def _place_announced(
        self, link: PeerLink, transfer_id: int, runs: list[Run], tag: _Tag | None, part: int, parts: int = 1
    ) -> None:
        """A request to a peer on this host announced before its copy: its intent (the
        ``placed`` header) goes into the peer's ring before any byte is copied and a
        :class:`~omni_async.wire.Commit` follows the copy.  With a notice (``tag``), so that the
        peer knows of the write even if this process dies during the copy; without one (a
        large write), so that the peer checks the runs during the copy and is awake, polling
        its ring, when the commit comes (see :data:`ANNOUNCE_BYTES`).  With no room in a ring
        (none, full, broken) a request with a notice travels over UCX behind its header (one
        gathered message: the window share it took), one without is copied and then told.
        ``part`` of ``parts``: which request of the write this is (a notice's tag says so too)."""
        seq = link.outbox.take_seq(0)
        intent = _write_request(transfer_id, seq, runs, tag, placed=True, intent=tag is None, part=part, parts=parts)
        try:
            in_ring = link.direct is not None and self._ring_put(link, KIND_HEADER, (encode_record(intent),))
        except RingError as exc:
            self._drop(link, exc)  # first: its removal fails what it was sent (this one too, if it was current)
            self._settle(link, transfer_id, PeerLost(f"peer {link.peer.peer_id!r} broke the ring: {exc}"))
            return
        if not in_ring:
            if tag is None:
                self._place(link, transfer_id, runs)
            else:
                self._post_write(link, transfer_id, runs, True, tag)
            return
        if tag is not None:
            self._count_noticed(link, transfer_id, lane=False)
        if self._copy(link, transfer_id, runs):
            self._send_header(link, Commit(transfer_id, part), transfer_id)

    def _copy(self, link: PeerLink, transfer_id: int, runs: list[Run]) -> bool:
        """Copy the runs into the peer's region (same host); False if that failed.

        A peer process that exited fails the transfer with PeerLost and is dropped (reported
        through ``fault``, like a broken lane); any other failure (no permission) fails this
        transfer only, with TransferFailed, and later writes go through UCX.  A request posted
        after the lane was closed (a later part of the same write, or one queued for the
        window) fails the same way.  On False the request's window share is the caller's to
        free: withdrawn if nothing was sent, answered by the peer if its intent is in the ring
        (the transfer's ``Abort`` fails the intent).
        """
        direct = link.direct
        if direct is None:
            self._settle(link, transfer_id, TransferFailed("the same-host lane to the peer was closed"))
            return False
        try:
            direct.place(self._arrays, runs)
        except OSError as exc:
            self._copy_failed(link, transfer_id, exc)
            return False
        return True

    def _copy_failed(self, link: PeerLink, transfer_id: int, exc: OSError) -> None:
        """A copy of the transfer's rows into the peer's region failed (see :meth:`_copy`)."""
        self._drop_direct(link)
        if exc.errno == errno.ESRCH:  # the peer process is gone: as a broken lane
            self._lose(link, transfer_id, PeerLost(f"peer {link.peer.peer_id!r} exited: {exc}"))
        else:
            log.warning("same-host write to %s failed, using UCX from now on: %s", link.peer.peer_id, exc)
            self._settle(link, transfer_id, TransferFailed(f"same-host write failed: {exc}"))

    def _if_live(self, link: PeerLink, transfer_id: int, post: Callable[[], None]) -> None:
        """Carry out ``post`` (a request of a split write, or one held by :meth:`_gate`) only
        while its transfer is not settled.  The window hands out several requests at once; once one of them settled the
        transfer (a copy that failed; a cancel or deadline while they waited) the others are
        never sent (one sent after the transfer's ``Abort`` started a notice at the receiver
        that could never end, holding every later notice behind it): their window shares are
        freed instead."""
        if transfer_id in link.sent:
            post()
        else:
            carry_out(link.outbox.withdraw(transfer_id))

    def _gate(self, link: PeerLink, transfer_id: int, ring: bool, post: Callable[[], None]) -> None:
        """Post a request with a notice in write order: behind the ones held already and, if it
        goes into the ring (``ring``), only once every such header sent over the lane is
        answered (a ring record could overtake it, and notices follow write order)."""
        if link.held or (ring and link.lane_noticed):
            link.held.append((transfer_id, ring, post))
        else:
            post()

    def _release_held(self, link: PeerLink) -> None:
        """Post the held requests that may go now, in order (see :meth:`_gate`)."""
        held = link.held
        while held and not (held[0][1] and link.lane_noticed):
            transfer_id, _ring, post = held.popleft()
            self._if_live(link, transfer_id, post)  # (settled while it waited: its share is freed)

    @staticmethod
    def _count_noticed(link: PeerLink, transfer_id: int, *, lane: bool) -> None:
        """A request with a notice is posted (``lane``: its header went over UCX)."""
        link.notice_answers[transfer_id] = link.notice_answers.get(transfer_id, 0) + 1
        if lane:
            link.lane_noticed.add(transfer_id)


@dataclass(frozen=True, slots=True)
class _Tag:
    """The notice of a write and which of its requests this is."""

    data: bytes
    part: int
    parts: int


def _write_request(
    transfer_id: int,
    seq: int,
    runs: list[Run],
    tag: _Tag | None,
    *,
    gathered: bool = True,
    placed: bool = False,
    intent: bool = False,
    part: int = 0,
    parts: int = 1,
    tail: bool = False,
) -> WriteRequest:
    """A write request's header; ``part`` of ``parts`` unless the notice's ``tag`` says."""
    pairs = [(remote, length) for _local, remote, length in runs]
    if tag is None:
        return WriteRequest(transfer_id, seq, pairs, gathered, placed, part=part, parts=parts, intent=intent, tail=tail)
    return WriteRequest(transfer_id, seq, pairs, gathered, placed, tag.data, tag.part, tag.parts)


def _answered_by_consumption(link: PeerLink) -> bool:
    """Whether a placed request alone in its transfer goes as ``tail`` (the peer's consumption
    of its ring record answers it): both rings are up, the peer's to put it into and ours,
    where the peer wakes us and the answer is watched (:meth:`.RingReceiver.answers_from`)."""
    return link.ring_in is not None and link.ring_out is not None


def _request_blocks(request: list[Run], blocks: int, requests: int) -> int:
    """Blocks of one request of a write of ``blocks`` split into ``requests``."""
    return blocks if requests == 1 else sum(run[2] for run in request)


def _refuse_read(link: PeerLink, refuse: Callable[[BaseException | None], None], error: BaseException) -> None:
    """Refuse one of the peer's read requests with ``error``, logged for its first refusal only
    (a reader that keeps asking is refused quietly; :attr:`PeerLink.reads_refused` counts)."""
    if not link.reads_refused:
        log.warning("refusing reads from %s: %s", link.peer.peer_id, error)
    link.reads_refused += 1
    refuse(error)
