"""Config tooling: ``config check`` (load like a service, print the effective values or the error
naming the field and value) and ``config docs`` (the field reference, generated from the structs)."""

from __future__ import annotations

import argparse
import ast
import contextlib
import difflib
import inspect
import itertools
import json
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from ..config import REDACTED, SECRET_FIELDS
from .output import EXIT_FAILED, EXIT_OK, emit_json, err

BEGIN_MARK = "<!-- BEGIN omni-async config docs -->"
END_MARK = "<!-- END omni-async config docs -->"


def redact(data: dict[str, Any]) -> dict[str, Any]:
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
    from ..config import ENV_PREFIX, AdapterOptions, AgentConfig, ConnectorSpec, RegionConfig

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
    if parts[-1] in SECRET_FIELDS or (unknown and _may_be_secret(parts[-1])):
        return field, REDACTED
    env_name = ENV_PREFIX + "__".join(parts).upper()
    if env_name in environ:
        return field, environ[env_name]
    value: Any = None
    if path is not None:
        with contextlib.suppress(Exception):
            from ..config import _read_file

            node: Any = _read_file(Path(path))
            for part in parts:
                node = node[int(part)] if isinstance(node, list) else node[part]
            value = node
    return field, value


def _may_be_secret(name: str) -> bool:
    """Whether an unknown field's name may be a misspelled secret field (its value is not shown)."""
    return "secret" in name.lower() or bool(difflib.get_close_matches(name, SECRET_FIELDS, n=1, cutoff=0.6))


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
    from ..config import ENV_PREFIX, ServiceConfig
    from ..connector import UcxOptions

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


def write_reference(path: Path) -> bool:
    """Replace the text between the markers in ``path``; True if it changed."""
    text = path.read_text()
    start, end = text.find(BEGIN_MARK), text.find(END_MARK)
    if start < 0 or end < start:
        raise ValueError(f"{path} has no {BEGIN_MARK} … {END_MARK} block")
    updated = text[: start + len(BEGIN_MARK)] + "\n\n" + config_reference() + "\n" + text[end:]
    if updated != text:
        path.write_text(updated)
    return updated != text



# -- the commands ---------------------------------------------------------------------------
def cmd_config_check(args: argparse.Namespace) -> int:
    from ..config import ServiceConfig, load_config
    from ..errors import ConfigError

    environ: Mapping[str, str] = {} if args.no_env else os.environ
    try:
        config = load_config(path=args.file, environ=environ, schema=ServiceConfig)
    except ConfigError as exc:
        message = str(exc)
        field, value = explain_config_error(message, args.file, environ)
        if args.json:
            emit_json({"ok": False, "file": args.file, "error": message, "field": field, "value": value})
        else:
            where = f" ({field} = {value!r})" if field and value is not None else f" ({field})" if field else ""
            err(f"config error{where}: {message}")
        return EXIT_FAILED
    data = msgspec.to_builtins(config)
    if not args.show_secrets:
        data = redact(data)
    if args.json:
        emit_json({"ok": True, "file": args.file, "config": data})
    else:
        sys.stdout.write(to_toml(data))
        print(f"# ok: {args.file or '(defaults)'}{'' if args.no_env else ' + OMNI_ASYNC_* variables'}",
              file=sys.stderr)
    return EXIT_OK


def cmd_config_docs(args: argparse.Namespace) -> int:
    if args.write:
        try:
            changed = write_reference(Path(args.write))
        except (OSError, ValueError) as exc:  # no such file, or not one with the reference's markers
            err(f"config docs --write {args.write}: {exc}")
            return EXIT_FAILED
        print(f"{args.write}: {'updated' if changed else 'already current'}", file=sys.stderr)
    else:
        sys.stdout.write(config_reference())
    return EXIT_OK

