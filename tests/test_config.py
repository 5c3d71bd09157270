"""Configuration: every source, precedence, and errors that name the field, value and rule."""

import json

import pytest

from omni_async import Agent, BlockRegion, ConfigError
from omni_async.config import AgentConfig, ServiceConfig, check_ucx_environment, load_config, ucx_tls_selects_cma


def test_defaults_work_on_one_machine():
    config = load_config(environ={})
    assert isinstance(config, AgentConfig)
    assert config.host == "127.0.0.1" and config.port == 0 and config.ucx_tls == "^cma"


@pytest.mark.parametrize(
    "name,text",
    [
        ("c.json", json.dumps({"agent": {"port": 5000}, "region": {"num_blocks": 8}})),
        ("c.toml", "[agent]\nport = 5000\n[region]\nnum_blocks = 8\n"),
        ("c.yaml", "agent:\n  port: 5000\nregion:\n  num_blocks: 8\n"),
    ],
)
def test_files(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    config = load_config(path=path, environ={}, schema=ServiceConfig)
    assert config.agent.port == 5000 and config.region.num_blocks == 8


def test_precedence_file_then_data_then_environment(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[agent]\nport = 1\nhost = '0.0.0.0'\n[adapter]\nmax_in_flight = 3\n")
    env = {"OMNI_ASYNC_AGENT__PORT": "3", "OMNI_ASYNC_AGENT__CONFIG_FIELDS": '{"model": "m"}', "OTHER": "x"}
    config = load_config({"agent": {"port": 2}}, path=path, environ=env, schema=ServiceConfig)
    assert config.agent.port == 3 and config.agent.host == "0.0.0.0"  # env wins, file fills the rest
    assert config.agent.config_fields == {"model": "m"} and config.adapter.max_in_flight == 3


@pytest.mark.parametrize(
    "data,words",
    [
        ({"port": 70000}, ["port", "65535"]),
        ({"heartbeat_timeout": -1}, ["heartbeat_timeout", "0"]),
        ({"prot": 1}, ["prot"]),
        ({"ucx_tls": "cma,tcp"}, ["cma", "aborts"]),
        ({"heartbeat_interval": 5, "heartbeat_timeout": 1}, ["heartbeat_timeout", "heartbeat_interval"]),
    ],
)
def test_errors_name_field_and_rule(data, words):
    with pytest.raises(ConfigError) as info:
        load_config(data, environ={})
    for word in words:
        assert word in str(info.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(path=tmp_path / "missing.toml", environ={})
    bad = tmp_path / "c.ini"
    bad.write_text("x")
    with pytest.raises(ConfigError, match="must end in"):
        load_config(path=bad, environ={})
    broken = tmp_path / "c.json"
    broken.write_text("{")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config(path=broken, environ={})


@pytest.mark.parametrize(
    "value,selects",
    [  # as UCX 1.21 resolves UCX_TLS (ucp_tl_aliases, allow-list parsing)
        ("^cma", False), ("tcp", False), ("posix,sysv,self,tcp", False), ("mm,tcp", False),
        ("^sm", False), ("^shm,tcp", False), ("^\\cma", False), ("tcp,all", False),
        ("cma", True), ("\\cma", True), ("sm", True), ("shm", True), ("all", True), ("^all", True),
        ("cma:aux", True), ("sm:aux", True), ("tcp,,shm", True),
        ("^tcp", True), ("^mm", True), ("^", True), ("", True), ("^cma:aux", True), ("^\\sm", True),
        ("^ cma", True), ("^CMA", True),  # UCX neither strips nor folds case
        ("^" + "tcp," * 128 + "cma", True),  # UCX reads the first 128 entries only
    ],
)
def test_ucx_tls_resolution(value, selects):
    assert ucx_tls_selects_cma(value) is selects
    if selects:
        with pytest.raises(ConfigError, match=r"ucx_tls.*cma"):
            AgentConfig(ucx_tls=value)
    else:
        assert AgentConfig(ucx_tls=value).ucx_tls == value


def test_ucx_tls_in_the_environment_is_checked():
    check_ucx_environment(AgentConfig(), {"UCX_TLS": "^cma"})  # the same value: fine
    check_ucx_environment(AgentConfig(ucx_tls="tcp"), {})
    with pytest.raises(ConfigError, match="cma"):
        check_ucx_environment(AgentConfig(), {"UCX_TLS": "sm"})
    with pytest.raises(ConfigError, match="ucx_tls"):
        check_ucx_environment(AgentConfig(), {"UCX_TLS": "tcp"})


async def test_agent_refuses_to_start_under_a_different_ucx_tls(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "shm,tcp")
    agent = Agent(BlockRegion.allocate(4, 4096), AgentConfig())
    with pytest.raises(ConfigError, match="ucx_tls"):
        await agent.start()
    await agent.close()



def test_a_peer_id_longer_than_the_wire_carries_is_refused():
    """A peer id over 256 characters is refused when configured (it was accepted, and then
    every handshake timed out: the peer could not decode the Hello)."""
    from omni_async.wire import MAX_PEER_ID

    assert AgentConfig(peer_id="p" * MAX_PEER_ID).peer_id == "p" * MAX_PEER_ID
    with pytest.raises(ConfigError, match="peer_id"):
        AgentConfig(peer_id="p" * (MAX_PEER_ID + 1))


@pytest.mark.parametrize(
    "endpoint,words",
    [("https://etcd:2379", ["https://etcd:2379", "TLS"]), ("etcd:65536", ["65536", "1..65535"]), ("etcd:0", ["port 0"])],
)
def test_an_etcd_endpoint_discovery_cannot_dial_as_asked_is_refused(endpoint, words):
    """An https endpoint was dialled in plaintext and an impossible port accepted (then every
    session failed at run time): both refused when the configuration loads."""
    with pytest.raises(ConfigError) as info:
        load_config({"discovery": {"etcd": [endpoint]}}, environ={}, schema=ServiceConfig)
    for word in words:
        assert word in str(info.value)
    ok = load_config({"discovery": {"etcd": ["http://etcd:2379", "etcd:65535"]}}, environ={}, schema=ServiceConfig)
    assert ok.discovery.etcd == ["http://etcd:2379", "etcd:65535"]
