"""The data plane: awaitable transfers over per-peer UCX lanes."""

from .lane import Lane
from .transfer import CancelMode, State, Transfer
from .ucx import Frames, MessageSink, UcxTransport

__all__ = ["CancelMode", "Frames", "Lane", "MessageSink", "State", "Transfer", "UcxTransport"]
