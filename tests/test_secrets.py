"""A CURVE secret key is never printed or logged, not even in part: config errors, reprs, log
lines and CLI output (human and JSON) are checked for any 8 consecutive characters of it."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

from omni_async import ConfigError, HandshakeTimeout
from omni_async.auth import generate_keypair
from omni_async.config import AgentConfig, ServiceConfig, load_config

from .test_cli import environment, omni_many

pytestmark = pytest.mark.timeout(60)


def leaks(secret: str, text: str) -> list[str]:
    return [secret[i:i + 8] for i in range(len(secret) - 7) if secret[i:i + 8] in text]


def bad_secret() -> str:
    return generate_keypair()[1][:39] + "~"  # 40 characters, not Z85


def test_cli_config_check_never_prints_the_secret(tmp_path: Path) -> None:
    pub, good = generate_keypair()
    bad = bad_secret()
    cases = {
        "bad.json": {"agent": {"curve_secret_key": bad, "curve_allowed_keys": [pub]}},
        "no_allowed.json": {"agent": {"curve_secret_key": good}},
        "good.json": {"agent": {"curve_secret_key": good, "curve_allowed_keys": [pub]}},
    }
    commands: list[tuple[tuple[str, ...], dict[str, str] | None]] = []
    for name, data in cases.items():
        (tmp_path / name).write_text(json.dumps(data))
        commands += [(("config", "check", str(tmp_path / name)), None),
                     (("config", "check", str(tmp_path / name), "--json"), None)]
    commands.append((("config", "check", "--json"), environment(OMNI_ASYNC_AGENT__CURVE_SECRET_KEY=bad)))
    results = omni_many(*commands)
    assert [r.returncode for r in results] == [1, 1, 1, 1, 0, 0, 1]
    for result in results:
        output = result.stdout + result.stderr
        assert leaks(bad, output) == [] and leaks(good, output) == [], output
    assert "curve_secret_key" in results[0].stderr  # the field is still named


def test_errors_and_reprs_never_show_the_secret() -> None:
    pub, good = generate_keypair()
    bad = bad_secret()
    with pytest.raises(ConfigError) as info:
        AgentConfig(curve_secret_key=bad, curve_allowed_keys=[pub])
    with pytest.raises(ConfigError) as loaded:
        load_config({"agent": {"curve_secret_key": bad}}, environ={}, schema=ServiceConfig)
    texts = [str(info.value), repr(info.value), str(loaded.value)]
    config = AgentConfig(curve_secret_key=good, curve_allowed_keys=[pub])
    service = ServiceConfig(agent=config)
    texts += [repr(config), str(config), repr(service), str(config.__rich_repr__())]
    assert config.curve_secret_key == good  # redacted only when shown
    for text in texts:
        assert leaks(bad, text) == [] and leaks(good, text) == [], text


async def test_agent_logs_never_show_the_secret(make_agent, caplog) -> None:
    a_pub, a_sec = generate_keypair()
    b_pub, b_sec = generate_keypair()
    stranger_pub, stranger_sec = generate_keypair()
    caplog.set_level(logging.DEBUG)
    a = await make_agent(peer_id="a", curve_secret_key=a_sec, curve_allowed_keys=[b_pub])
    b = await make_agent(peer_id="b", curve_secret_key=b_sec, curve_allowed_keys=[a_pub])
    stranger = await make_agent(peer_id="s", handshake_timeout=0.3, curve_secret_key=stranger_sec,
                                curve_allowed_keys=[b_pub])
    await asyncio.wait_for(a.connect(b.control_address), 10)
    with pytest.raises(HandshakeTimeout):
        await stranger.connect(b.control_address)
    logged = caplog.text + "".join(repr(r.args) for r in caplog.records)
    for secret in (a_sec, b_sec, stranger_sec):
        assert leaks(secret, logged) == []
    assert "refused control connection" in caplog.text  # something was logged about keys
