"""The sans-I/O core imports on its own: no ucxx, no zmq, no transport (which loads libucp);
the public names of the package load lazily; error codes register themselves."""

from __future__ import annotations

import subprocess
import sys

import pytest

import omni_async
from omni_async import errors

CORE = ["wire", "region", "serde", "handshake", "session", "errors", "config"]
HEAVY = ["ucxx", "zmq", "omni_async.transport", "omni_async.agent", "omni_async.control"]


@pytest.mark.parametrize("module", CORE)
def test_core_module_imports_without_io_libraries(module: str) -> None:
    probe = (f"import sys, omni_async.{module}; "
             f"print([name for name in {HEAVY!r} if name in sys.modules])")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "[]", result.stdout


def test_public_api_is_unchanged_and_lazy() -> None:
    probe = ("import sys, omni_async; loaded = 'omni_async.agent' in sys.modules; "
             "from omni_async import Agent, AgentConfig, PeerLost, Transfer, BlockRegion; "
             "print(loaded, Agent.__module__, Transfer.__name__, 'zmq' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.split() == ["False", "omni_async.agent", "Transfer", "True"]
    for name in omni_async.__all__:
        assert getattr(omni_async, name) is not None
    assert set(omni_async.__all__) <= set(dir(omni_async))
    with pytest.raises(AttributeError):
        omni_async.NoSuchName  # noqa: B018


def test_error_codes_register_themselves() -> None:
    # The same codes the hand-kept table had: each one names its class.
    assert set(errors.REMOTE_ERRORS) == {
        "error", "protocol", "rejected", "already_connected", "version", "fingerprint", "layout", "failed",
        "cancelled", "invalid_blocks", "invalid_message", "closed", "unknown_peer", "peer_lost", "deadline", "refused",
        "buffer_full", "batch_refused", "reads_not_allowed"}
    assert all(cls.code == code for code, cls in errors.REMOTE_ERRORS.items())
    assert "config" not in errors.REMOTE_ERRORS  # local-only errors stay local
    assert type(errors.error_from_code("peer_lost", "gone")) is errors.PeerLost
    assert type(errors.error_from_code("no-such-code", "?")) is errors.TransferFailed
    with pytest.raises(TypeError, match="taken"):
        type("Clash", (errors.OmniAsyncError,), {"code": "peer_lost"}, remote=True)
    assert errors.REMOTE_ERRORS["peer_lost"] is errors.PeerLost
