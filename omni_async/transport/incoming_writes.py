"""Incoming block writes, the receiving side: a write request validated before any payload is
received (its rows straight into the region, a refused one's payload into scratch), intents
and their commits, aborts, and the notices and acknowledgements each write ends with.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

from ..errors import (
    InvalidBlocks,
    ProtocolError,
    error_from_code,
)
from ..wire import (
    MAX_PENDING_PAYLOADS,
    Abort,
    Commit,
    WriteRequest,
    validate_write,
)
from .core import TransportCore, carry_out, ignore
from .lane import Completion
from .link import PeerLink, peer_elsewhere
from .notices import Notice, sink_error

log = logging.getLogger(__name__)

INTENT_WAIT = 3e-3
"""Seconds a receiver polls its ring for the commit of an intent before it sleeps again
(the longest copy it stays awake for; a later commit wakes it as any record does)."""


class IncomingWrites(TransportCore):
    """The incoming-write methods of :class:`~.ucx.UcxTransport` (receiving side)."""

    def _on_write(self, link: PeerLink, req: WriteRequest) -> None:
        """A block write: each run's rows of every region of the set, run by run (gathered:
        one payload message; else one per run and region, in that order).  From a removed peer
        whose lane still drains, a payload is taken into scratch: no row is written (a placed
        write's rows the peer wrote itself: it is still recorded, for its failed notice)."""
        if not req.placed and self._links.get(link.peer.peer_id) is not link:
            self._drain(link, req, InvalidBlocks("the peer was removed"), ignore)
            return
        messages = 1 if req.gathered else len(req.runs) * len(self._arrays)
        try:
            blocks = validate_write(req, self.num_blocks, self.config.max_write_blocks)
        except ProtocolError as exc:
            refuse = self._answerer(link, req, 0, valid=False)
            if refuse is None:
                return
            if req.placed:  # nothing to drain: no payload follows
                log.warning("refused placed write %d from %s: %s", req.transfer_id, link.peer.peer_id, exc)
                if not req.announced:
                    refuse(InvalidBlocks(str(exc)))
                else:
                    self._intend(link, req, refuse, InvalidBlocks(str(exc)))
            else:
                self._drain(link, req, InvalidBlocks(str(exc)), refuse)
            return
        if req.placed and req.notice is None and not req.intent:  # copied already, no notice: answered now
            self._answer(link, req.transfer_id, "blocks", blocks * self.regions.block_bytes, None)
            return
        finish = self._answerer(link, req, blocks * self.regions.block_bytes, valid=True)
        if finish is None:
            return
        if req.placed:  # an intent: the rows will be copied, answered on its commit
            self._intend(link, req, finish, None)
            return
        if not self._admit(link, req.seq, messages, 0):
            return
        rows = self._rows(req.runs)
        if req.gathered:
            self._expect(link, req.seq, rows, finish)  # scattered straight into the region rows
        else:
            parts = _Countdown(len(rows), finish)
            for i, row in enumerate(rows):
                if not self._expect(link, req.seq + i, [row], parts.done):
                    return

    def _on_ring_write(self, link: PeerLink, req: WriteRequest) -> None:
        """A write request from the peer's ring.  One its consumption answers (``tail``) is
        checked here and answered by no :class:`~omni_async.wire.Ack`: the ring's tail passes
        it once its record is given back, the peer is woken at the batch's end if it sleeps
        and the write counted in the metrics then (:meth:`_flush_acks`); invalid, it breaks
        the protocol (its sender checked it against our layout).  Any other: as from the lane."""
        if not (req.tail and req.placed and req.notice is None and not req.intent):
            self._on_write(link, req)
            return
        try:
            blocks = validate_write(req, self.num_blocks, self.config.max_write_blocks)
        except ProtocolError as exc:
            raise ProtocolError(f"a write answered by the ring's tail is invalid: {exc}") from None
        if self._links.get(link.peer.peer_id) is not link:
            return  # removed, its ring drained: nobody awaits the answer
        link.tail_acked.append(req.transfer_id)
        link.tail_bytes += blocks * self.regions.block_bytes  # (counted by _flush_acks)

    def _intend(self, link: PeerLink, req: WriteRequest, answer: Completion, refusal: InvalidBlocks | None) -> None:
        """An intent: the sender copies its rows now; it is answered (``refusal``, or done)
        on its commit, or fails on the write's abort or the peer's loss."""
        if len(link.intents) >= MAX_PENDING_PAYLOADS:
            self._drop(link, ProtocolError(f"over {MAX_PENDING_PAYLOADS} intents awaiting a commit"))
            return
        if (req.transfer_id, req.part) in link.intents:
            error = ProtocolError(f"a second intent of write {req.transfer_id} part {req.part} before its commit")
            self._drop(link, error)
            return
        first = not link.intents
        link.intents[req.transfer_id, req.part] = (answer, refusal)
        # The sender copies now: its commit is near.  Armed once per pending intent (a peer that
        # keeps announcing intents it does not commit cannot keep us polling), and not for a
        # peer in this process (it cannot copy while we poll).
        if first and link.ring_in is not None and peer_elsewhere(link):
            link.ring_in.stay_awake(INTENT_WAIT)

    def _on_commit(self, link: PeerLink, commit: Commit) -> None:
        """The rows of an intent are copied: answer it (a commit with no intent: dropped)."""
        intent = link.intents.pop((commit.transfer_id, commit.part), None)
        if intent is None:
            error = ProtocolError(f"commit of write {commit.transfer_id} part {commit.part}, which announced no intent")
            self._drop(link, error)
            return
        answer, refusal = intent
        if not link.intents and link.ring_in is not None:
            link.ring_in.stay_awake(0)  # no other commit is due
        answer(refusal)

    def _abort_write(self, link: PeerLink, abort: Abort) -> None:
        """The sender gave a write with a notice up: it fails once the requests seen are in;
        its intents with no commit (a copy that failed) fail now.  (Any other id: nothing.)"""
        error = error_from_code(abort.code, abort.reason or "the sender gave the write up")
        self._queue_notices(link.notices.aborted(abort.transfer_id, error))
        for key in [key for key in link.intents if key[0] == abort.transfer_id]:
            answer, _refusal = link.intents.pop(key)
            answer(error)
        if not link.intents and link.ring_in is not None:
            link.ring_in.stay_awake(0)

    def _answerer(self, link: PeerLink, req: WriteRequest, nbytes: int, *, valid: bool) -> Completion | None:
        """What answers this write request: its acknowledgement, through the peer's notice
        book if it carries a notice (``valid``: its rows may be written).  None if the request
        broke the protocol (the peer is dropped)."""
        answer = partial(self._answer, link, req.transfer_id, "blocks", nbytes)
        if req.notice is None:
            return answer
        limit = self.config.max_notice_bytes
        try:
            if not limit or len(req.notice) > limit:
                raise ProtocolError(f"notice of {len(req.notice)} bytes exceeds this side's limit of {limit}")
            link.notices.seen(req.transfer_id, req.part, req.parts, req.runs if valid else [], req.notice)
        except ProtocolError as exc:
            self._drop(link, exc)
            return None
        return partial(self._answer_noticed, link, req.transfer_id, answer)

    def _answer_noticed(
        self, link: PeerLink, transfer_id: int, answer: Completion, error: BaseException | None
    ) -> None:
        """A request of a write with a notice is done: the acknowledgement that completes
        the write waits until its notice is queued (and the notices before it)."""
        if self._links.get(link.peer.peer_id) is not link:
            return  # the peer is gone: its notice book already failed the write
        failed = None if error is None else sink_error(error)
        held, ready = link.notices.done(transfer_id, failed, partial(answer, error))
        if not held:
            answer(error)
        self._queue_notices(ready)

    def _queue_notices(self, ready: list[tuple[Notice, list[Callable[[], None]]]]) -> None:
        for notice, acks in ready:
            self.notices.offer(notice, partial(carry_out, acks))

    def _drain(self, link: PeerLink, req: WriteRequest, reason: InvalidBlocks, refuse: Completion) -> None:
        """Take a refused write's payload (truncated into scratch: nothing is allocated, nothing
        lingers in UCX's queues), then send the refusal."""
        lens = self.regions.block_lens
        sizes = [count * block_len for _, count in req.runs for block_len in lens]
        if not self._admit(link, req.seq, 1 if req.gathered else len(sizes), 0):
            return
        log.warning("refused write %d from %s: %s", req.transfer_id, link.peer.peer_id, reason)
        parts = _Countdown(1 if req.gathered else len(sizes), lambda _error: refuse(reason))
        if req.gathered:
            self._expect(link, req.seq, [link.scratch], parts.done, sum(sizes))
        else:
            for i, size in enumerate(sizes):
                if not self._expect(link, req.seq + i, [link.scratch], parts.done, size):
                    return


class _Countdown:
    """Calls ``finish(first error or None)`` once ``count`` parts are done."""

    __slots__ = ("error", "finish", "remaining")

    def __init__(self, count: int, finish: Completion) -> None:
        self.remaining = count
        self.error: BaseException | None = None
        self.finish = finish

    def done(self, error: BaseException | None) -> None:
        if error is not None and self.error is None:
            self.error = error
        self.remaining -= 1
        if self.remaining == 0:
            self.finish(self.error)
