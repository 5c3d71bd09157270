"""Transport modes of the block rows: what each contender is told to use.

``shm`` is each library's same-host choice with its defaults (omni_async: ``AgentConfig``'s
defaults, i.e. the single-copy same-host lane for blocks and ``ucx_tls="^cma"`` for the rest;
NIXL: whatever its UCX backend picks, which is cma for puts).  ``tcp`` stands for two hosts: it
forces ``UCX_TLS=tcp`` on both (omni_async through ``AgentConfig(ucx_tls="tcp",
same_host_lane=False)``, NIXL through the environment of its processes).  Both stay on the
loopback interface (``UCX_NET_DEVICES=lo``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

NET_DEVICES = "lo"
HEARTBEAT_TIMEOUT_S = 30.0
"""Every bench agent's ``heartbeat_timeout`` (default 3 s).  The bench process times memcpy and
checks bytes in synchronous stretches; on a loaded 2-core host those can outlast 3 s, and idle
agents of the other mode then lost their peer mid-run.  The bench measures transfers, not how
fast a silent peer is noticed (the tests prove that)."""


@dataclass(frozen=True, slots=True)
class Mode:
    name: str
    suffix: str
    """Appended to workload names in result rows ("" or "_tcp")."""
    omni_tls: str | None
    """``AgentConfig.ucx_tls``; None keeps the default."""
    nixl_env: dict[str, str] = field(default_factory=dict)
    same_host_lane: bool = True
    """``AgentConfig.same_host_lane``: off where the mode stands for peers on two hosts."""

    def omni_config(self, peer_id: str) -> dict[str, object]:
        """Config mapping for an omni_async agent in this mode."""
        config: dict[str, object] = {"peer_id": peer_id, "ucx_net_devices": NET_DEVICES,
                                     "heartbeat_timeout": HEARTBEAT_TIMEOUT_S}
        if self.omni_tls is not None:
            config["ucx_tls"] = self.omni_tls
        if not self.same_host_lane:
            config["same_host_lane"] = False
        return config


SHM = Mode("shm", "", None, {"UCX_NET_DEVICES": NET_DEVICES})
TCP = Mode("tcp", "_tcp", "tcp", {"UCX_NET_DEVICES": NET_DEVICES, "UCX_TLS": "tcp"}, same_host_lane=False)
