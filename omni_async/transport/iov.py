"""A lane's UCP endpoint and tag messages (scattered and gathered too), via ctypes on ucxx's worker.

ucxx's Python API sends one contiguous buffer per message, and each message costs 3-9 µs of
Python; a write of 256 scattered blocks paid that 256 times.  UCP itself takes an IOV datatype
(a list of ``(address, length)`` pairs): the sender gathers, the receiver scatters straight
into its region rows, in one message.  This module calls ``ucp_tag_send_nbx`` and
``ucp_tag_msg_recv_nbx`` (after ``ucp_tag_probe_nb``) from the very libucp that ucxx loaded, on
the worker handle ucxx exposes, and tracks the returned UCP requests itself.

The endpoint is created and closed here too (``ucp_ep_create``, ``ucp_ep_close_nbx``), not by
ucxx: a ucxx request holds its endpoint and worker, so one that UCX can never finish (a
rendezvous send or receive, or the endpoint's flush-close, with a peer that died or is
stopped: UCX 1.21's ``ucp_request_cancel`` only takes a posted receive off the expected queue,
and ``ucp_ep_close_nbx`` refuses a force close without error handling with
``UCS_ERR_INVALID_PARAM``) kept the worker and its descriptors alive for good.  A raw request
holds nothing: when its lane drops the ucxx worker, ``ucp_worker_destroy`` destroys the
endpoint and whatever it still holds.

Contract: the buffers named by an IOV must stay alive and unchanged until the request completes
(:class:`~omni_async.transport.lane.Lane` keeps them referenced).  Requests are polled with
:func:`status` and released with :func:`free`.

Threading: nothing here is shared and mutable (libucp is opened once, on first use; each
prober passes its own :class:`RecvInfo`), so lanes on different threads do not interfere.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final, TypeVar

import numpy as np
import numpy.typing as npt

from ..region import Run, run_table

if TYPE_CHECKING:
    from _ctypes import CFuncPtr

UCS_OK: Final = 0
UCS_INPROGRESS: Final = 1
_UCP_OP_ATTR_FIELD_DATATYPE: Final = 1 << 3
_UCP_DATATYPE_IOV: Final = 2
_UCS_ERR_LAST: Final = -100
_UCP_EP_PARAM_FIELD_REMOTE_ADDRESS: Final = 1 << 0
_UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE: Final = 1 << 1
_UCP_ERR_HANDLING_MODE_NONE: Final = 0


class _RequestParam(ctypes.Structure):
    """``ucp_request_param_t`` (UCX >= 1.10); only ``op_attr_mask`` and ``datatype`` are set."""

    _fields_ = (
        ("op_attr_mask", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("request", ctypes.c_void_p),
        ("cb", ctypes.c_void_p),
        ("datatype", ctypes.c_uint64),
        ("user_data", ctypes.c_void_p),
        ("reply_buffer", ctypes.c_void_p),
        ("memory_type", ctypes.c_int),
        ("recv_info", ctypes.c_void_p),
        ("memh", ctypes.c_void_p),
    )


class _ErrHandler(ctypes.Structure):
    """``ucp_err_handler_t``: an error callback and its argument."""

    _fields_ = (("cb", ctypes.c_void_p), ("arg", ctypes.c_void_p))


class _SockAddr(ctypes.Structure):
    """``ucs_sock_addr_t``: a ``struct sockaddr *`` and its length."""

    _fields_ = (("addr", ctypes.c_void_p), ("addrlen", ctypes.c_uint32))


class _EpParams(ctypes.Structure):
    """``ucp_ep_params_t`` (UCX 1.21); only ``field_mask``, ``address`` and ``err_mode`` are set."""

    _fields_ = (
        ("field_mask", ctypes.c_uint64),
        ("address", ctypes.c_void_p),
        ("err_mode", ctypes.c_int),
        ("err_handler", _ErrHandler),
        ("user_data", ctypes.c_void_p),
        ("flags", ctypes.c_uint),
        ("sockaddr", _SockAddr),
        ("conn_request", ctypes.c_void_p),
        ("name", ctypes.c_char_p),
        ("local_sockaddr", _SockAddr),
    )


_F = TypeVar("_F", bound="CFuncPtr")


def _declared(function: _F, restype: type[Any] | None, *argtypes: type[Any]) -> _F:
    """``function`` with its C signature set: ``restype function(argtypes...)``."""
    function.restype = restype
    function.argtypes = argtypes
    return function


class _Ucp:
    """The libucp functions this module calls, declared with their C signatures."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, size, u64, status = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_int8
        param = ctypes.POINTER(_RequestParam)
        self.send = _declared(lib.ucp_tag_send_nbx, ptr, ptr, ptr, size, u64, param)
        self.recv = _declared(lib.ucp_tag_msg_recv_nbx, ptr, ptr, ptr, size, ptr, param)
        self.check = _declared(lib.ucp_request_check_status, status, ptr)
        self.free = _declared(lib.ucp_request_free, None, ptr)
        self.probe = _declared(lib.ucp_tag_probe_nb, ptr, ptr, u64, u64, ctypes.c_int, ptr)
        self.ep_create = _declared(lib.ucp_ep_create, status, ptr, ctypes.POINTER(_EpParams), ctypes.POINTER(ptr))
        self.ep_close = _declared(lib.ucp_ep_close_nbx, ptr, ptr, param)
        self.strerror = _declared(lib.ucs_status_string, ctypes.c_char_p, status)


@functools.cache
def library() -> ctypes.CDLL:
    """The libucp ucxx already loaded (the same copy: UCP state is per library instance),
    opened on first use, never at import (:mod:`.rma` declares more of its functions)."""
    import libucx

    path = os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so")
    return ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LOCAL)


@functools.cache
def _ucp() -> _Ucp:
    return _Ucp(library())


# Read-only request parameters (UCX only reads them): safe to share between threads.
_PARAM = _RequestParam(op_attr_mask=_UCP_OP_ATTR_FIELD_DATATYPE, datatype=_UCP_DATATYPE_IOV)
_PARAM_REF = ctypes.byref(_PARAM)
_CONTIG_REF = ctypes.byref(_RequestParam())  # no datatype field: contiguous bytes


def iov_of(buffers: list[npt.NDArray[np.uint8]]) -> npt.NDArray[np.uint64]:
    """The ``ucp_dt_iov_t`` array (address, length) of C-contiguous byte arrays, in order.

    Addresses come from :func:`address_of` and the array is built once from a list: a third
    of the cost of ``__array_interface__`` and an element store per buffer (256 region rows:
    ~120 µs instead of ~365 µs, measured)."""
    return np.array([(address_of(buffer), buffer.nbytes) for buffer in buffers], np.uint64).reshape(-1, 2)


def iov_of_runs(arrays: Sequence[npt.NDArray[np.uint8]], runs: Sequence[Run]) -> npt.NDArray[np.uint64]:
    """The ``ucp_dt_iov_t`` array of the rows ``[local, local + length)`` of each run
    2-D C-contiguous byte array, run by run and, within a run, array by array (the order of a
    write's gathered payload): computed from each array's address and row length, with no
    view per row (256 one-block runs: ~30 µs, :func:`iov_of` of their rows ~200 µs)."""
    vector = np.empty((len(runs), len(arrays), 2), np.uint64)
    fill_local_rows(vector, arrays, run_table(runs))
    return vector.reshape(-1, 2)


def fill_local_rows(
    out: npt.NDArray[np.uint64], arrays: Sequence[npt.NDArray[np.uint8]], table: npt.NDArray[np.uint64]
) -> None:
    """Fill columns 0 and 1 of ``out`` (shape ``(runs, arrays, >= 2)``) with the address and byte
    length of each run's rows in each 2-D C-contiguous array (``table``: :func:`run_table`)."""
    for i, array in enumerate(arrays):
        row = np.uint64(array.shape[1])
        out[:, i, 0] = np.uint64(array.__array_interface__["data"][0]) + table[:, 0] * row
        out[:, i, 1] = table[:, 2] * row


class RecvInfo(ctypes.Structure):
    """``ucp_tag_recv_info_t``, which :func:`probe` fills in.  Each prober owns one (a lane
    has its own): ctypes calls release the GIL, so a shared one could be overwritten by
    another thread's probe between the call and the read."""

    _fields_ = (("sender_tag", ctypes.c_uint64), ("length", ctypes.c_size_t))


def probe(worker: Any, tag: int, mask: int, info: RecvInfo) -> tuple[int, int, int] | None:
    """Take the oldest arrived message matching ``tag``/``mask`` off the worker's queue.

    Returns ``(message, sender_tag, length)`` (read from the caller's ``info``); the message
    must then be received with :func:`recv` (it is removed from UCX's queue).  None if
    nothing matches.
    """
    message = _ucp().probe(worker.handle, tag, mask, 1, ctypes.byref(info))
    if not message:
        return None
    return message, info.sender_tag, info.length


def connect(worker: Any, address: bytes) -> int:
    """Create an endpoint of ``worker`` to the worker at ``address`` (a UCP worker address),
    without endpoint error handling; return its handle.  Raises :class:`OSError` if UCX refuses.

    The endpoint is ours, not ucxx's: close it with :func:`close`, once.
    """
    params = _EpParams(field_mask=_UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | _UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
                       address=ctypes.cast(ctypes.c_char_p(address), ctypes.c_void_p).value,
                       err_mode=_UCP_ERR_HANDLING_MODE_NONE)
    endpoint = ctypes.c_void_p()
    code = _ucp().ep_create(worker.handle, ctypes.byref(params), ctypes.byref(endpoint))
    if code != UCS_OK:
        raise error(code)
    return int(endpoint.value or 0)


def close(endpoint: int) -> int:
    """Start a flush-close of an endpoint from :func:`connect`: a request to poll (and free), or
    0 if already closed.  Raises :class:`OSError` with UCX's reason if it could not start.

    The request never holds the worker alive: whatever UCX still holds (sends to a peer that
    died or stopped, this close) is destroyed with the worker.
    """
    return _checked(_ucp().ep_close(endpoint, _CONTIG_REF))


def address_of(view: npt.NDArray[np.uint8]) -> int:
    """The address of a C-contiguous byte array's first byte (ctypes on a writable one: a third of
    the cost of numpy's ``ctypes.data``; it refuses read-only and empty ones)."""
    if view.nbytes and view.flags.writeable:
        return ctypes.addressof(ctypes.c_char.from_buffer(view.data))
    return int(view.__array_interface__["data"][0])


def send_bytes(endpoint: int, tag: int, address: int, length: int) -> int:
    """Post one tag send of ``length`` contiguous bytes at ``address`` (UCX's plain path); a
    request to poll, or 0 if already done.  Raises :class:`OSError` with UCX's reason if the
    send could not be posted."""
    return _checked(_ucp().send(endpoint, address, length, tag, _CONTIG_REF))


def send(endpoint: int, tag: int, iov: npt.NDArray[np.uint64]) -> int:
    """Post one tag send gathering ``iov`` (two or more elements: one goes by
    :func:`send_bytes`); return a request to poll, or 0 if already done.

    Raises :class:`OSError` with UCX's reason if the send could not be posted.
    """
    return _checked(_ucp().send(endpoint, iov.ctypes.data, len(iov), tag, _PARAM_REF))


def recv_bytes(worker: Any, message: int, address: int, length: int) -> int:
    """Receive a ``message`` from :func:`probe` into ``length`` contiguous bytes at ``address``;
    a request to poll, or 0 if done.  Keeps UCX's zero-copy paths, which an IOV receive
    disables (measured 3x slower over tcp)."""
    return _checked(_ucp().recv(worker.handle, address, length, message, _CONTIG_REF))


def recv(worker: Any, message: int, iov: npt.NDArray[np.uint64]) -> int:
    """Receive a ``message`` from :func:`probe` scattering into ``iov`` (two or more elements:
    one goes by :func:`recv_bytes`); a request to poll, or 0 if done."""
    return _checked(_ucp().recv(worker.handle, iov.ctypes.data, len(iov), message, _PARAM_REF))


def status(request: int) -> int:
    """``UCS_INPROGRESS``, ``UCS_OK`` or a negative UCX error code."""
    return int(_ucp().check(request))


def free(request: int) -> None:
    """Release a request (UCX frees an unfinished one when it completes)."""
    _ucp().free(request)


def error(code: int) -> OSError:
    reason = _ucp().strerror(code)
    return OSError(f"UCX: {reason.decode() if reason else code}")


def _checked(pointer: int | None) -> int:
    if not pointer:
        return 0
    as_signed = ctypes.c_int64(pointer).value
    if _UCS_ERR_LAST <= as_signed < 0:
        raise error(as_signed)
    return pointer
