"""Which process a peer on this host is: a challenge over its lane, answered inside that process.

A peer's :class:`~omni_async.wire.RegionShare` (and its :class:`~omni_async.wire.RingOffer`)
names a process id and proves that this process holds what it offers; it does not prove that
this process is the peer.  A proof the offering process made for everybody (a token at an
address, a memfd's name) can be replayed: an admitted peer that joined another agent on this
host could hand us that agent's share, and our writes would land in that agent's region.

So before the same-host lane is used, each side sends the other a
:class:`~omni_async.wire.ProofRequest` with a random nonce over the lane; the answering side
creates, and holds open for the link's life, an empty memfd named by :func:`proof_name` of
that nonce and of the challenger's peer id *as the answering side knows it*, then answers
:class:`~omni_async.wire.ProofReady` naming its descriptor.  The challenger then uses a share
or ring of process ``pid`` only if that descriptor of ``pid`` is that memfd
(:func:`holds_proof`: one ``readlink`` of ``/proc/<pid>/fd/<fd>``).  A peer cannot make
another process hold it: a process names the proofs it makes with its challenger's id, so a
peer that relays our nonce to a third agent gets a proof named with its own id, not ours
(unless it joins that agent under our id: peer ids are claims, which CURVE limits to the
holders of allowed keys; see docs/reliability.md, "Same-host lane: trust model").

Pure functions and one descriptor; the lane messages are the transport's (:mod:`.peers`).
"""

from __future__ import annotations

import hashlib
import os
import secrets
from typing import Final

from ..memfd import NAME_PREFIX, link_name
from .shared import Refused, check_link

PROOF_PREFIX: Final = "proof-"
"""The start of every proof's token (its memfd is named ``omni-proof-...``, see
:data:`~omni_async.memfd.NAME_PREFIX`)."""


def new_nonce() -> str:
    """A fresh challenge: 128 random bits as 32 hex digits."""
    return secrets.token_hex(16)


def proof_name(nonce: str, challenger: str) -> str:
    """The token of the memfd that answers ``nonce`` from the peer ``challenger`` (its peer
    id); the memfd is named as every segment of ours is, :data:`~omni_async.memfd.NAME_PREFIX`
    then the token."""
    digest = hashlib.sha256(f"{nonce}\0{challenger}".encode()).hexdigest()[:32]
    return PROOF_PREFIX + digest


def make_proof(nonce: str, challenger: str) -> int:
    """Create the proof for ``challenger``'s ``nonce``: an empty memfd of that name, whose
    descriptor the caller holds (and closes) for as long as the proof must stand.  Raises
    :class:`OSError` if it cannot be made."""
    return os.memfd_create(NAME_PREFIX + proof_name(nonce, challenger), os.MFD_CLOEXEC)


def holds_proof(pid: int, fd: int, name: str) -> bool:
    """Whether descriptor ``fd`` of process ``pid`` is the memfd of proof ``name`` (False if it
    is not, or cannot be read: gone, closed, or not ours to inspect).  One ``readlink``: the
    prover says which descriptor holds its proof (``ProofReady.fd``)."""
    if fd < 0:
        return False
    try:
        check_link(f"/proc/{pid}/fd/{fd}", link_name(name))
    except Refused:
        return False
    return True
