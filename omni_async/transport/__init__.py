"""The data plane: awaitable transfers over per-peer UCX lanes."""

from .lane import Lane
from .link import Frames, MessageRetract, MessageSink
from .transfer import CancelMode, State, Transfer
from .ucx import UcxTransport

__all__ = ["CancelMode", "Frames", "Lane", "MessageRetract", "MessageSink", "State", "Transfer", "UcxTransport"]
