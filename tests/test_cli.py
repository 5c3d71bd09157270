"""The ``omni-async`` command line, run as a user would: subprocesses, loopback, tiny sizes."""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from omni_async import cli
from omni_async.auth import check_key, public_key
from omni_async.cli import checkout

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "omni_async.cli"]
FAST_AGENT = {"OMNI_ASYNC_AGENT__HEARTBEAT_INTERVAL": "0.1", "OMNI_ASYNC_AGENT__HEARTBEAT_TIMEOUT": "1.0",
              "OMNI_ASYNC_AGENT__HANDSHAKE_TIMEOUT": "2.0"}


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_ASYNC_")}
    return {**env, "UCX_NET_DEVICES": "lo", **extra}


def omni(*args: str, timeout: float = 30, env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], cwd=cwd, env=env or environment(), capture_output=True, text=True,
                          timeout=timeout)


def omni_many(*commands: tuple[tuple[str, ...], dict[str, str] | None]) -> list[subprocess.CompletedProcess[str]]:
    """Run several commands at once (each ``(args, env)``); their results in order."""
    procs = [subprocess.Popen([*CLI, *args], cwd=ROOT, env=env or environment(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for args, env in commands]
    results = []
    for (args, _), proc in zip(commands, procs, strict=True):
        out, err = proc.communicate(timeout=30)
        results.append(subprocess.CompletedProcess([*CLI, *args], proc.returncode, out, err))
    return results


def readline(proc: subprocess.Popen[str], timeout: float = 15) -> str:
    """The child's next stdout line, failing after ``timeout`` s instead of hanging."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "no output from the child in time"
    return proc.stdout.readline()


@pytest.fixture
def receiver() -> Iterator[Any]:
    """``start(*args)``: an ``omni-async recv --json ...`` child and its listening event."""
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
        proc = subprocess.Popen([*CLI, "recv", "--json", *args], cwd=ROOT, env=environment(**FAST_AGENT),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(proc)
        event = json.loads(readline(proc))
        assert event["event"] == "listening" and event["address"].startswith("tcp://127.0.0.1:")
        return proc, event

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


# -- help and usage ---------------------------------------------------------------------------
def test_help_explains_every_command() -> None:
    commands = [["--help"], *([c, "--help"] for c in ("demo", "recv", "send", "bench", "keygen", "config")),
                ["config", "check", "--help"], ["config", "docs", "--help"]]
    procs = [subprocess.Popen([*CLI, *c], cwd=ROOT, env=environment(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for c in commands]
    outputs = [p.communicate(timeout=30) for p in procs]
    for command, proc, (out, err) in zip(commands, procs, outputs, strict=True):
        assert proc.returncode == 0, (command, err)
        assert out.startswith("usage: omni-async"), command
    main_help = outputs[0][0]
    for name in ("demo", "recv", "send", "bench", "keygen", "config"):
        assert f"    {name}" in main_help
    assert "--chunk-size" in outputs[3][0] and "--sessions" in outputs[2][0] and "--no-env" in outputs[7][0]
    usage = omni()
    assert usage.returncode == 2 and "required" in usage.stderr


def test_sizes_and_toml_helpers() -> None:
    assert [cli.parse_size(s) for s in ("4096", "64K", "64KiB", "1.5m", "2G")] == [4096, 65536, 65536, 1572864, 2 << 30]
    for bad in ("", "0", "-1", "12X", "K"):
        with pytest.raises(argparse.ArgumentTypeError):
            cli.parse_size(bad)
    data = {"a": {"b": 1, "c": [1, "x"], "d": None, "e": {"f": True, "g": {}}}, "h": {"i": 1.5, "j": "q\"\n"}}
    assert tomllib.loads(cli.to_toml(data)) == {"a": {"b": 1, "c": [1, "x"], "e": {"f": True, "g": {}}},
                                                 "h": {"i": 1.5, "j": "q\"\n"}}


# -- keygen ---------------------------------------------------------------------------------
def test_keygen_human_and_json() -> None:
    human, as_json = omni_many((("keygen",), None), (("keygen", "--json"), None))
    assert human.returncode == 0 and as_json.returncode == 0
    lines = dict(line.split(": ", 1) for line in human.stdout.splitlines())
    keys = json.loads(as_json.stdout)
    for public, secret in ((lines["public key"], lines["secret key"]), (keys["public_key"], keys["secret_key"])):
        check_key(public, "public")
        assert public_key(secret) == public
    assert keys["public_key"] != lines["public key"]


# -- config check -------------------------------------------------------------------------------
def test_config_check_prints_the_effective_config(tmp_path: Path) -> None:
    secret = json.loads(omni("keygen", "--json").stdout)
    good = tmp_path / "service.yaml"
    good.write_text(f"agent:\n  peer_id: talker\n  port: 5555\n  curve_secret_key: '{secret['secret_key']}'\n"
                    f"  curve_allowed_keys: ['{secret['public_key']}']\nregion:\n  num_blocks: 8\n")
    result, as_json, defaults = omni_many(
        (("config", "check", str(good)), environment(OMNI_ASYNC_ADAPTER__STALL_TIMEOUT="7")),
        (("config", "check", str(good), "--json", "--no-env", "--show-secrets"),
         environment(OMNI_ASYNC_ADAPTER__STALL_TIMEOUT="7")),
        (("config", "check", "--json"), None),
    )
    assert result.returncode == 0, result.stderr
    effective = tomllib.loads(result.stdout)
    assert effective["agent"]["peer_id"] == "talker" and effective["agent"]["port"] == 5555
    assert effective["region"] == {"num_blocks": 8, "block_len": 65536}
    assert effective["adapter"]["stall_timeout"] == 7.0  # the environment applies
    assert effective["agent"]["curve_secret_key"] == "<redacted>" and secret["secret_key"] not in result.stdout

    report = json.loads(as_json.stdout)
    assert report["ok"] and report["config"]["adapter"]["stall_timeout"] == 30.0  # --no-env
    assert report["config"]["agent"]["curve_secret_key"] == secret["secret_key"]

    assert json.loads(defaults.stdout)["config"]["agent"]["host"] == "127.0.0.1"


@pytest.mark.parametrize(("name", "text", "field", "value"), [
    ("bad.toml", "[agent]\nport = 70000\n", "agent.port", 70000),
    ("bad.json", '{"agent": {"ucx_tls": "cma,tcp"}}', "agent.ucx_tls", "cma,tcp"),
    ("bad.yaml", "region:\n  num_blokcs: 8\n", "region.num_blokcs", 8),
])
def test_config_check_names_the_bad_field_and_value(tmp_path: Path, name: str, text: str, field: str, value: Any) -> None:
    path = tmp_path / name
    path.write_text(text)
    human, as_json = omni_many((("config", "check", str(path)), None), (("config", "check", str(path), "--json"), None))
    assert human.returncode == 1 and human.stdout == ""
    assert f"{field} = {value!r}" in human.stderr
    report = json.loads(as_json.stdout)
    assert (report["ok"], report["field"], report["value"]) == (False, field, value)


def test_config_check_never_shows_the_value_of_a_misspelled_secret_field(tmp_path: Path) -> None:
    """The value of an unknown field was shown, also of ``curve_secret_kay`` (a secret key under
    a misspelled name); such a field's value is redacted, its name still given."""
    path = tmp_path / "typo.toml"
    secret = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
    path.write_text(f'[agent]\ncurve_secret_kay = "{secret}"\n')
    human, as_json = omni_many((("config", "check", str(path)), None), (("config", "check", str(path), "--json"), None))
    assert human.returncode == 1 and "agent.curve_secret_kay" in human.stderr
    assert secret not in human.stderr + human.stdout and secret not in as_json.stdout
    assert json.loads(as_json.stdout)["value"] == "<redacted>"


def test_config_check_reports_env_values_and_unreadable_files(tmp_path: Path) -> None:
    env_error, missing = omni_many(
        (("config", "check", "--json"), environment(OMNI_ASYNC_AGENT__HEARTBEAT_TIMEOUT="soon")),
        (("config", "check", str(tmp_path / "nope.toml")), None),
    )
    report = json.loads(env_error.stdout)
    assert env_error.returncode == 1 and (report["field"], report["value"]) == ("agent.heartbeat_timeout", "soon")
    assert missing.returncode == 1 and "cannot read config file" in missing.stderr


# -- recv / send ----------------------------------------------------------------------------------
def test_send_to_recv_on_loopback(receiver) -> None:
    proc, listening = receiver("--sessions", "1", "--duration", "25")
    sent = omni("send", listening["address"], "--json", "--requests", "2", "--chunks", "3", "--chunk-size", "1K",
                "--blocks", "4", env=environment(**FAST_AGENT))
    assert sent.returncode == 0, sent.stderr
    report = json.loads(sent.stdout)
    assert report["ok"] and report["chunks"] == 6 and report["bytes"] == 6 * 1024 and report["blocks"] == 4
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    events = [json.loads(line) for line in out.splitlines()]
    chunks = [e for e in events if e["event"] == "chunk"]
    assert len(chunks) == 6 and all(c["ok"] and c["bytes"] == 1024 for c in chunks)
    assert sorted((c["request"], c["index"]) for c in chunks if c["final"]) == \
        [(f"{report['session']}-0", 2), (f"{report['session']}-1", 2)]
    summary = next(e for e in events if e["event"] == "summary")
    assert summary["ok"] and summary["chunks"] == 6 and summary["blocks"] == 4 and summary["bad_blocks"] == 0
    assert events[-1] == {"event": "stopped", "reason": "sessions", "sessions": 1, "ok_sessions": 1, "ok": True}


def test_send_human_summary_table(receiver) -> None:
    _, listening = receiver("--quiet")
    sent = omni("send", listening["address"], "--requests", "1", "--chunks", "2", "--chunk-size", "512",
                env=environment(**FAST_AGENT))
    assert sent.returncode == 0, sent.stderr
    assert "throughput" in sent.stdout and "1 × 2" in sent.stdout


def test_recv_stops_cleanly_on_ctrl_c(receiver) -> None:
    proc, _ = receiver()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err
    assert json.loads(out.splitlines()[-1])["reason"] == "signal"
    assert "Traceback" not in err


def test_send_failures_are_reported_not_raised() -> None:
    nobody, bad_address = omni_many(
        (("send", "tcp://127.0.0.1:1", "--json"), environment(OMNI_ASYNC_AGENT__HANDSHAKE_TIMEOUT="0.5")),
        (("send", "localhost:5555"), None),
    )
    report = json.loads(nobody.stdout)
    assert nobody.returncode == 1 and not report["ok"] and report["error"].startswith("HandshakeTimeout")
    assert "Traceback" not in nobody.stderr
    assert bad_address.returncode == 2 and "not a control address" in bad_address.stderr


# -- demo / bench delegation --------------------------------------------------------------------
def test_bench_delegates_to_the_checkout() -> None:
    if not (ROOT / "bench" / "__main__.py").is_file():
        pytest.skip("no bench package in this checkout")
    result = omni("bench", "--", "--help")
    assert result.returncode == 0 and "python -m bench" in result.stdout


def test_demo_and_bench_without_a_checkout_say_so(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(checkout, "find_checkout", lambda _relative: None)
    assert cli.main(["demo"]) == cli.EXIT_USAGE
    assert "examples/demo.py" in capsys.readouterr().err
    assert cli.main(["bench", "blocks"]) == cli.EXIT_USAGE
    assert "bench/" in capsys.readouterr().err


def test_send_refuses_requests_without_chunks() -> None:
    """A request of zero chunks has no final chunk, so its receiver could only wait for a stall."""
    result = omni("send", "tcp://127.0.0.1:1", "--chunks", "0")
    assert result.returncode == 2 and "must be >= 1" in result.stderr



def test_bad_input_is_an_error_and_an_exit_status_never_a_traceback(tmp_path: Path) -> None:
    """A scrape target whose port is no number, ``config docs --write`` to a missing file or to
    one without the reference's markers, ``recv`` on a port another socket holds: each prints
    why and exits nonzero (each ended in a traceback)."""
    import socket

    plain = tmp_path / "plain.md"
    plain.write_text("no markers here\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        results = omni_many(
            (("top", "--once", "--interval", "0.1", "localhost:abc"), None),
            (("config", "docs", "--write", str(tmp_path / "missing.md")), None),
            (("config", "docs", "--write", str(plain)), None),
            (("recv", "--port", str(port), "--duration", "2"), None),
        )
    for result, says in zip(results, ("abc", "No such file", "BEGIN omni-async config docs", "recv failed"), strict=True):
        assert result.returncode != 0, result.args
        assert "Traceback" not in result.stderr, result.stderr[-600:]
        assert says in result.stderr, (result.args, result.stderr[-600:])
