"""The seed facades: the synchronous contracts of the code omni_async replaces, kept exactly.

* :mod:`.transport`: :class:`SyncDataTransport`, the seed ``DataTransport`` (thread and poll);
* :mod:`.adapter`: :class:`SyncTransferAdapter`, the seed ``OmniTransferAdapterBase``;
* :mod:`.card`: the agent card, the opaque bytes of ``get_agent_metadata()``;
* :mod:`.portal`: the :class:`~.portal.Portal` each facade runs its event loop in.

The documented import path is :mod:`omni_async.compat`, which re-exports these names.
"""

from __future__ import annotations

from .adapter import Chunk, SyncTransferAdapter
from .card import AgentCard, decode_agent_metadata
from .transport import PollResult, SyncDataTransport

__all__ = ["AgentCard", "Chunk", "PollResult", "SyncDataTransport", "SyncTransferAdapter", "decode_agent_metadata"]
