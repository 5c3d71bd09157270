"""Discovery through etcd: agents publish a card and join the peers of their group.

Sans-I/O parts: :mod:`.card` (the card and its keys), :mod:`.membership` (whom to dial, what
changed).  The asyncio part, :class:`~omni_async.discovery.etcd.Discovery`, needs the optional
``aetcd`` client (``pip install 'omni_async[discovery]'``) and is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .card import Card, decode_card, encode_card
from .membership import Membership, incompatibility, selects, should_dial

if TYPE_CHECKING:
    from .etcd import Discovery

__all__ = ["Card", "Discovery", "Membership", "decode_card", "encode_card", "incompatibility", "selects",
           "should_dial"]


def __getattr__(name: str) -> Any:
    if name == "Discovery":
        from .etcd import Discovery

        return Discovery
    raise AttributeError(name)
