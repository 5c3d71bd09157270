"""The documented name of the seed facades: synchronous drop-ins for code that cannot become async yet.

* :class:`SyncDataTransport`: the seed ``DataTransport`` contract (``write_blocks`` returning an
  id, ``poll``, ``cancel`` with ``"immediate"`` / ``"wait"``) over an :class:`~omni_async.Agent`;
* :class:`SyncTransferAdapter`: the seed ``OmniTransferAdapterBase`` contract (``save_async``,
  ``load_async``, drained books) over a :class:`~omni_async.adapter.TransferAdapter`.

They live in :mod:`omni_async.seed` (one module per seed contract, the agent card, and the
portal that owns each facade's event-loop thread); this module re-exports them.
"""

from __future__ import annotations

from .seed import AgentCard, Chunk, PollResult, SyncDataTransport, SyncTransferAdapter, decode_agent_metadata

__all__ = ["AgentCard", "Chunk", "PollResult", "SyncDataTransport", "SyncTransferAdapter", "decode_agent_metadata"]
