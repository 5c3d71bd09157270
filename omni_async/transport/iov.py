"""Scatter/gather tag messages: one UCX message for many buffers, via ctypes on ucxx's handles.

ucxx's Python API sends one contiguous buffer per message, and each message costs 3-9 µs of
Python; a write of 256 scattered blocks paid that 256 times.  UCP itself takes an IOV datatype
(a list of ``(address, length)`` pairs): the sender gathers, the receiver scatters straight
into its region rows, in one message.  This module calls ``ucp_tag_send_nbx`` and
``ucp_tag_msg_recv_nbx`` (after ``ucp_tag_probe_nb``) from the very libucp that ucxx loaded, on
the endpoint and worker handles ucxx exposes, and tracks the returned UCP requests itself.

Contract: the buffers named by an IOV must stay alive and unchanged until the request completes
(:class:`~omni_async.transport.lane.Lane` keeps them referenced).  Requests are polled with
:func:`status` and released with :func:`free`.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Final

import numpy as np
import numpy.typing as npt

UCS_OK: Final = 0
UCS_INPROGRESS: Final = 1
_UCP_OP_ATTR_FIELD_DATATYPE: Final = 1 << 3
_UCP_DATATYPE_IOV: Final = 2
_UCS_ERR_LAST: Final = -100


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


def _libucp() -> ctypes.CDLL:
    """The libucp ucxx already loaded (the same copy: UCP state is per library instance)."""
    import libucx

    path = os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so")
    return ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LOCAL)


_ucp = _libucp()
_send = _ucp.ucp_tag_send_nbx
_send.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, ctypes.POINTER(_RequestParam)]
_send.restype = ctypes.c_void_p
_recv = _ucp.ucp_tag_msg_recv_nbx
_recv.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.POINTER(_RequestParam)]
_recv.restype = ctypes.c_void_p
_check = _ucp.ucp_request_check_status
_check.argtypes = [ctypes.c_void_p]
_check.restype = ctypes.c_int8
_free = _ucp.ucp_request_free
_free.argtypes = [ctypes.c_void_p]
_free.restype = None
_probe = _ucp.ucp_tag_probe_nb
_probe.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int, ctypes.c_void_p]
_probe.restype = ctypes.c_void_p
_strerror = _ucp.ucs_status_string
_strerror.argtypes = [ctypes.c_int8]
_strerror.restype = ctypes.c_char_p

_PARAM = _RequestParam(op_attr_mask=_UCP_OP_ATTR_FIELD_DATATYPE, datatype=_UCP_DATATYPE_IOV)
_PARAM_REF = ctypes.byref(_PARAM)
_CONTIG_REF = ctypes.byref(_RequestParam())  # no datatype field: contiguous bytes


def iov_of(buffers: list[npt.NDArray[np.uint8]]) -> npt.NDArray[np.uint64]:
    """The ``ucp_dt_iov_t`` array (address, length) of C-contiguous byte arrays, in order."""
    iov = np.empty((len(buffers), 2), np.uint64)
    for i, buffer in enumerate(buffers):
        iov[i, 0] = buffer.__array_interface__["data"][0]
        iov[i, 1] = buffer.nbytes
    return iov


class _RecvInfo(ctypes.Structure):
    """``ucp_tag_recv_info_t``."""

    _fields_ = (("sender_tag", ctypes.c_uint64), ("length", ctypes.c_size_t))


_INFO = _RecvInfo()
_INFO_REF = ctypes.byref(_INFO)


def probe(worker: Any, tag: int, mask: int) -> tuple[int, int, int] | None:
    """Take the oldest arrived message matching ``tag``/``mask`` off the worker's queue.

    Returns ``(message, sender_tag, length)``; the message must then be received with
    :func:`recv` (it is removed from UCX's queue).  None if nothing matches.
    """
    message = _probe(worker.handle, tag, mask, 1, _INFO_REF)
    if not message:
        return None
    return message, _INFO.sender_tag, _INFO.length


def send(endpoint: Any, tag: int, iov: npt.NDArray[np.uint64]) -> int:
    """Post one tag send gathering ``iov``; return a request to poll, or 0 if already done.

    Raises :class:`OSError` with UCX's reason if the send could not be posted.
    """
    return _checked(_send(endpoint.handle, iov.ctypes.data, len(iov), tag, _PARAM_REF))


def recv(worker: Any, message: int, iov: npt.NDArray[np.uint64]) -> int:
    """Receive a ``message`` from :func:`probe` scattering into ``iov``; a request to poll, or 0
    if done.  A single element is received as contiguous bytes (keeps UCX's zero-copy paths,
    which an IOV receive disables: measured 3x slower over tcp)."""
    if len(iov) == 1:
        return _checked(_recv(worker.handle, int(iov[0, 0]), int(iov[0, 1]), message, _CONTIG_REF))
    return _checked(_recv(worker.handle, iov.ctypes.data, len(iov), message, _PARAM_REF))


def status(request: int) -> int:
    """``UCS_INPROGRESS``, ``UCS_OK`` or a negative UCX error code."""
    return int(_check(request))


def free(request: int) -> None:
    """Release a request (UCX frees an unfinished one when it completes)."""
    _free(request)


def error(code: int) -> OSError:
    reason = _strerror(code)
    return OSError(f"UCX: {reason.decode() if reason else code}")


def _checked(pointer: int | None) -> int:
    if not pointer:
        return 0
    as_signed = ctypes.c_int64(pointer).value
    if _UCS_ERR_LAST <= as_signed < 0:
        raise error(as_signed)
    return pointer
