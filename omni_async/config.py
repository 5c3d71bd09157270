"""Typed configuration, free of I/O apart from reading a named file.

:class:`AgentConfig` holds everything the control plane and the transport need; every field
has a default that works on one machine.  Build one with :func:`load_config` from a mapping,
a JSON/TOML/YAML file and ``OMNI_ASYNC_*`` environment variables; a bad value raises
:class:`~omni_async.errors.ConfigError` naming the field, the value and what is allowed.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, TypeVar

import msgspec

from .errors import ConfigError
from .wire import DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_MAX_WRITE_BLOCKS, MAX_NOTICE_BYTES, MAX_PEER_ID

PositiveSeconds = Annotated[float, msgspec.Meta(gt=0)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Positive = Annotated[int, msgspec.Meta(ge=1)]

ENV_PREFIX = "OMNI_ASYNC_"
SECRET_FIELDS = frozenset({"curve_secret_key"})
"""Fields never printed or logged (any part of them): reprs, errors and the CLI redact them."""
REDACTED = "<redacted>"
CONNECT_RULE = r"^(all|none|role:[\w.-]+)$"
"""A discovery ``connect`` rule: ``all``, ``none`` or ``role:NAME``."""
T = TypeVar("T", bound=msgspec.Struct)


_Z85 = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
_Z85_VALUE = {char: value for value, char in enumerate(_Z85)}


def check_key(key: str, what: str) -> None:
    """Raise :class:`ConfigError` unless ``key`` is a 40-character Z85 CURVE key (32 bytes).

    The message never shows the value, not even part of it: it may be a secret key.
    """
    valid = len(key) == 40 and all(char in _Z85_VALUE for char in key)
    for start in range(0, len(key), 5) if valid else ():
        word = 0
        for char in key[start : start + 5]:
            word = word * 85 + _Z85_VALUE[char]
        valid = valid and word < 1 << 32  # five Z85 digits can exceed four bytes
    if not valid:
        raise ConfigError(f"{what} must be a 40-character Z85 CURVE key (got {len(key)} characters that are not one)")


class AgentConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Settings of one agent (control plane + UCX transport)."""

    peer_id: str = ""
    """This side's unique id (at most 256 characters); empty picks ``host-pid-random``."""
    host: str = "127.0.0.1"
    """Interface the control plane binds (``0.0.0.0`` for all)."""
    port: Port = 0
    """Control-plane TCP port; 0 picks a free one (see ``Agent.control_address``)."""
    config_fields: dict[str, Any] | None = None
    """Model config values hashed into the compatibility fingerprint (None: compatible with all)."""
    advertise_host: str = ""
    """Host put in ``control_address`` for peers (e.g. this machine's address when ``host`` is
    ``0.0.0.0``); empty uses the bound address."""
    handshake_timeout: PositiveSeconds = 5.0
    """Seconds to wait for the peer's answer to our hello before HandshakeTimeout."""
    heartbeat_interval: PositiveSeconds = 0.5
    """Seconds between heartbeats to each peer; must be below ``heartbeat_timeout``."""
    heartbeat_timeout: PositiveSeconds = 3.0
    """A peer silent for this long is lost; its in-flight transfers fail with PeerLost."""
    transfer_timeout: PositiveSeconds = 60.0
    """A transfer not acknowledged within this fails with DeadlineExceeded."""
    lane_close_grace: PositiveSeconds = 5.0
    """Seconds a removed peer's UCX endpoint may take to close (it needs the peer's answer)
    before its worker is destroyed anyway: what closing a peer that stopped answering costs."""
    ucx_tls: str = "^cma"
    """UCX_TLS for the data plane.  cma is excluded: it aborts the sender when a receiver dies."""
    ucx_net_devices: str = ""
    """UCX_NET_DEVICES (e.g. ``lo`` for loopback tests); empty lets UCX choose."""
    max_peers: Positive = 64
    """Most peers joined or being admitted at once; handshakes beyond it are rejected."""
    max_write_blocks: Positive = DEFAULT_MAX_WRITE_BLOCKS
    """Most blocks one incoming write may name."""
    max_message_bytes: Positive = DEFAULT_MAX_MESSAGE_BYTES
    """Largest incoming chunk message (all frames together)."""
    max_notice_bytes: Annotated[int, msgspec.Meta(ge=0, le=MAX_NOTICE_BYTES)] = MAX_NOTICE_BYTES
    """Largest notice an incoming write may carry (0: refuse notices; at most 4096)."""
    notice_queue: Positive = 1024
    """Notices queued for the application (``Agent.notices()``); when full, the senders'
    writes wait for their acknowledgement until the application reads."""
    allow_reads: bool = False
    """Let peers read this side's region (``Agent.read_blocks``): any peer that passed the
    handshake may then copy any of its rows.  Announced in the handshake."""
    metrics_port: Port = 0
    """Serve Prometheus ``/metrics`` on this port (0: off).  One endpoint serves every agent of
    the process; start at most one agent with it set (a port taken raises ``ConfigError`` at
    start; the agent's close frees it)."""
    curve_secret_key: str = ""
    """This side's ZeroMQ CURVE secret key (Z85).  With it the control plane is encrypted and
    only peers whose public key is in ``curve_allowed_keys`` may connect.  Off by default
    (loopback demos); required across hosts.  ``omni-async keygen`` makes a pair."""
    curve_allowed_keys: list[str] = msgspec.field(default_factory=list)
    """Public keys (Z85) of the peers allowed to connect when CURVE is on."""
    same_host_lane: bool = True
    """Write blocks to peers on this host with one copy, straight into their region (mapped
    shared memory, else ``process_vm_writev``) instead of through UCX.  Such a peer can write
    any row of this side's region: turn it off unless peers on this host are trusted (see
    docs/reliability.md, "Same-host lane: trust model")."""
    shared_pool_mib: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 64
    """MiB of shared memory each same-host peer copies its large chunk messages (64 KiB or
    more) into, one copy per byte: one pool per such peer, its pages touched when first used
    and kept while the peer is joined; full or 0: they are copied through the message ring
    (see docs/tuning.md, "Shared pool").  Needs ``same_host_lane``."""
    ucx_puts: bool = True
    """Write blocks to peers without a same-host lane (``ucx_tls="tcp"``, other hosts) with
    one-sided UCX puts into their registered region, a flush and a ``placed`` header, once the
    peer offered its remote keys (see docs/tuning.md, "The tcp path"); off: as tag messages.
    Off on either side means tag messages between the two (no offer is made or taken)."""

    def __post_init__(self) -> None:
        if len(self.peer_id) > MAX_PEER_ID:  # (else every handshake would time out: the peer cannot decode it)
            raise ConfigError(f"peer_id of {len(self.peer_id)} characters exceeds {MAX_PEER_ID}")
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ConfigError(
                f"heartbeat_timeout ({self.heartbeat_timeout}) must exceed "
                f"heartbeat_interval ({self.heartbeat_interval})"
            )
        check_ucx_tls(self.ucx_tls, "ucx_tls")

        if self.curve_secret_key:
            check_key(self.curve_secret_key, "curve_secret_key")
            if not self.curve_allowed_keys:
                raise ConfigError("curve_allowed_keys must list at least one peer public key when CURVE is on")
            for key in self.curve_allowed_keys:
                check_key(key, "curve_allowed_keys entry")
        elif self.curve_allowed_keys:
            raise ConfigError("curve_allowed_keys is set but curve_secret_key is not")

    def __repr__(self) -> str:  # never show the secret key, not even in a traceback or a log line
        return f"AgentConfig({', '.join(f'{name}={value!r}' for name, value in self.__rich_repr__())})"

    def __rich_repr__(self) -> list[tuple[str, Any]]:
        return [(name, REDACTED if name in SECRET_FIELDS and getattr(self, name) else getattr(self, name))
                for name in self.__struct_fields__]

    def resolved_peer_id(self) -> str:
        return self.peer_id or f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"


# -- UCX_TLS, resolved the way UCX 1.21 does (src/ucs/config/parser.c: allow lists;
# src/ucp/core/ucp_context.c: ucp_tl_aliases, ucp_is_resource_in_transports_list) ----------------
_UCX_LIST_MAX = 128
"""UCS_CONFIG_ARRAY_MAX: UCX silently ignores the entries of a list after the 128th."""
_CMA_NAMES = frozenset({"cma", "\\cma"})
"""Names that select cma itself (a leading backslash means "no alias")."""
_CMA_ALIASES = frozenset({"sm", "shm"})
"""Aliases whose expansion lists cma (``sm``/``shm``: posix, sysv, xpmem, knem, cma)."""


def ucx_tls_selects_cma(value: str) -> bool:
    """True if UCX 1.21, given ``UCX_TLS=value``, may enable the cma transport.

    Mirrors UCX: a leading ``^`` negates the whole list; ``all`` as the first entry allows
    everything (even after ``^``); entries are split on ``,`` (empty ones skipped, nothing
    stripped, case kept) and only the first 128 count.  cma is selected by ``cma``, ``\\cma`` or an
    alias that lists it (``sm``, ``shm``), and as an auxiliary transport by the same names with
    ``:aux``; a negated list excludes cma only if it names cma or one of those aliases without
    ``:aux``.  An empty list is treated as selecting cma (UCX's own default is ``all``).
    """
    negate = value.startswith("^")
    names = [name for name in value[negate:].split(",") if name][:_UCX_LIST_MAX]
    if not names or names[0] == "all":
        return True
    primary = any(name in _CMA_NAMES or name in _CMA_ALIASES for name in names)
    if negate:
        return not primary
    auxiliary = any(name.endswith(":aux") and name[: -len(":aux")] in _CMA_NAMES | _CMA_ALIASES for name in names)
    return primary or auxiliary


def check_ucx_tls(value: str, source: str) -> None:
    """Raise :class:`ConfigError` naming ``source`` if ``UCX_TLS=value`` can select cma."""
    if ucx_tls_selects_cma(value):
        raise ConfigError(
            f"{source}={value!r} lets UCX select cma (directly, through an alias such as sm/shm/all, "
            "or by not excluding it), with which UCX aborts this process when a peer dies "
            "mid-transfer; use '^cma' (default), 'tcp' or 'posix,sysv,self,tcp'"
        )


def check_ucx_environment(config: AgentConfig, environ: Mapping[str, str]) -> None:
    """Refuse a ``UCX_TLS`` in the environment that differs from ``config.ucx_tls``.

    The agent's UCX contexts take their transports from the config field, which would
    silently override the variable; a mismatch is an error that names the field instead.
    """
    value = environ.get("UCX_TLS")
    if value is None or value == config.ucx_tls:
        return
    check_ucx_tls(value, "UCX_TLS in the environment (config field: ucx_tls)")
    raise ConfigError(
        f"UCX_TLS={value!r} is set in the environment but the agent's transports come from the "
        f"config field ucx_tls={config.ucx_tls!r}: set ucx_tls (OMNI_ASYNC_UCX_TLS) to the value "
        "you want and unset UCX_TLS"
    )


class RegionConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The block region a service allocates (``num_blocks × block_len`` bytes)."""

    num_blocks: Positive = 256
    """Blocks in the region a service allocates."""
    block_len: Positive = 64 * 1024
    """Bytes per block; must be equal on both sides of a pair (checked in the handshake)."""


class ConnectorSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Which connector to build (``name`` in the registry) and its options (``extra``)."""

    name: str = "ucx"
    """Registered connector to build (``ucx`` is built in; see ``register_connector``)."""
    extra: dict[str, Any] = msgspec.field(default_factory=dict)
    """Options of that connector, validated by its ``Options`` struct."""


class AdapterOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Chunk-stream settings of a :class:`~omni_async.adapter.TransferAdapter`."""

    stall_timeout: PositiveSeconds = 30.0
    """Seconds a waited-for request may go without a chunk before DeadlineExceeded."""
    max_in_flight: Positive = 256
    """Chunks sent and not yet acknowledged, per adapter."""
    drain_timeout: PositiveSeconds = 5.0
    """On close: how long queued and in-flight saves may take to finish."""


class DiscoveryConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Finding peers through etcd (off unless ``etcd`` lists an endpoint; see docs/discovery.md)."""

    etcd: list[Annotated[str, msgspec.Meta(pattern=r"^(https?://)?[^\s/:]+:\d+$")]] = msgspec.field(
        default_factory=list
    )
    """etcd v3 endpoints, ``host:port`` or ``http://host:port`` (tried in turn; plaintext: an
    ``https://`` endpoint is refused, not dialled without TLS); empty: discovery off."""
    prefix: Annotated[str, msgspec.Meta(pattern=r"^/[^\s]*$")] = "/omni_async"
    """Key prefix; this agent's card is stored under ``{prefix}/{group}/{peer_id}``."""
    group: Annotated[str, msgspec.Meta(pattern=r"^[^/\s]+$")] = "default"
    """Agents of one group find each other; other groups are not seen."""
    ttl: Annotated[int, msgspec.Meta(ge=2)] = 10
    """Seconds the card outlives this agent (its etcd lease, refreshed every ``ttl / 3``)."""
    role: Annotated[str, msgspec.Meta(max_length=64)] = ""
    """This agent's role in the card (e.g. ``prefill``, ``decode``), matched by ``connect`` rules."""
    connect: Annotated[str, msgspec.Meta(pattern=CONNECT_RULE)] = "all"
    """Whom to dial: ``all``, ``none`` or ``role:NAME``; each pair is dialled once."""
    retry_interval: PositiveSeconds = 1.0
    """Seconds between attempts to reach etcd after losing it, and between re-dials of a wanted
    peer that is not joined."""

    def __post_init__(self) -> None:
        for endpoint in self.etcd:
            if endpoint.startswith("https://"):
                raise ConfigError(
                    f"etcd endpoint {endpoint!r}: discovery speaks plaintext gRPC and has no TLS; "
                    "give host:port of an etcd reachable on a trusted network"
                )
            port = etcd_host_port(endpoint)[1]
            if not 0 < port < 65536:
                raise ConfigError(f"etcd endpoint {endpoint!r}: port {port} is not within 1..65535")


def etcd_host_port(endpoint: str) -> tuple[str, int]:
    """``(host, port)`` of an etcd endpoint as :attr:`DiscoveryConfig.etcd` admits it."""
    host, _, port = endpoint.rpartition("://")[2].rpartition(":")
    return host, int(port)


class ServiceConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything a :class:`~omni_async.service.ConnectorService` needs."""

    agent: AgentConfig = msgspec.field(default_factory=AgentConfig)
    region: RegionConfig = msgspec.field(default_factory=RegionConfig)
    connector: ConnectorSpec = msgspec.field(default_factory=ConnectorSpec)
    adapter: AdapterOptions = msgspec.field(default_factory=AdapterOptions)
    discovery: DiscoveryConfig = msgspec.field(default_factory=DiscoveryConfig)


def load_config(
    data: Mapping[str, Any] | None = None,
    *,
    path: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
    schema: type[T] = AgentConfig,  # type: ignore[assignment]
) -> T:
    """Merge a file, then ``data``, then ``OMNI_ASYNC_*`` variables; validate as ``schema``.

    Nested fields are reached with ``__`` in variable names (``OMNI_ASYNC_AGENT__PORT=5555``
    for :class:`ServiceConfig`).  ``environ`` defaults to ``os.environ``; ``{}`` ignores it.
    """
    merged: dict[str, Any] = {}
    if path is not None:
        merged.update(_read_file(Path(path)))
    _deep_update(merged, dict(data or {}))
    env = os.environ if environ is None else environ
    for key, value in env.items():
        if key.startswith(ENV_PREFIX) and len(key) > len(ENV_PREFIX):
            *parents, name = key[len(ENV_PREFIX) :].lower().split("__")
            target = merged
            for parent in parents:
                target = target.setdefault(parent, {})
                if not isinstance(target, dict):
                    raise ConfigError(f"{key} names a field inside {parent!r}, which is not a section")
            target[name] = _from_env(key, value)
    try:
        return msgspec.convert(merged, schema, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid configuration: {exc}") from None


def _deep_update(target: dict[str, Any], data: Mapping[str, Any]) -> None:
    for key, value in data.items():
        if isinstance(value, Mapping) and isinstance(target.get(key), dict):
            _deep_update(target[key], value)
        else:
            target[key] = value


def _from_env(key: str, value: str) -> Any:
    """Values that look like JSON objects, arrays or null are parsed; the rest stay strings."""
    if value[:1] in ("{", "[") or value == "null":
        try:
            return msgspec.json.decode(value)
        except msgspec.DecodeError as exc:
            raise ConfigError(f"{key} is not valid JSON: {exc}") from None
    return value


def _read_file(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    suffix = path.suffix.lower()
    try:
        if suffix == ".json":
            result = msgspec.json.decode(raw)
        elif suffix == ".toml":
            result = msgspec.toml.decode(raw)
        elif suffix in (".yaml", ".yml"):
            result = msgspec.yaml.decode(raw)
        else:
            raise ConfigError(f"config file {path} must end in .json, .toml, .yaml or .yml")
    except (msgspec.DecodeError, ImportError) as exc:
        raise ConfigError(f"cannot parse config file {path}: {exc}") from None
    if not isinstance(result, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top")
    return result
