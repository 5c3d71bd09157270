"""One-sided puts into a peer's region over UCX (lanes without a same-host writer: tcp, other hosts).

Each side registers the regions of its set with its UCX context (``ucp_mem_map``,
:class:`Registration`) and sends the packed remote keys (``ucp_rkey_pack``) to every such peer
in a :class:`~omni_async.wire.RkeyOffer`.  The sender unpacks them on its endpoint to that peer
(``ucp_ep_rkey_unpack``: it parses peer bytes, so a vetting child does it first, see
:mod:`.vetting`), then writes a request's rows with one ``ucp_put_nbi`` per run and region
(posted in one call of :mod:`.native` where it is built) and one ``ucp_ep_flush_nbx``; once the
flush completed the rows are in the peer's memory and a ``placed`` header tells it
(:mod:`.block_writes`).

Ownership: a :class:`Registration` belongs to its transport and is released with
:meth:`Registration.close` once no lane of it can be written any more; an unpacked key belongs
to the lane it was unpacked on (:meth:`~.lane.Lane.unpack_keys`) and is destroyed before that
lane's worker (UCX allocates it from the worker).  The functions here raise :class:`OSError`
with UCX's reason when UCX refuses.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from ..region import Run, run_table
from . import native
from .iov import _CONTIG_REF, UCS_OK, _checked, _declared, _RequestParam, error, fill_local_rows, library

_UCP_MEM_MAP_PARAM_FIELD_ADDRESS: Final = 1 << 0
_UCP_MEM_MAP_PARAM_FIELD_LENGTH: Final = 1 << 1


class _MemMapParams(ctypes.Structure):
    """``ucp_mem_map_params_t`` (UCX 1.21); only ``field_mask``, ``address`` and ``length`` are set."""

    _fields_ = (
        ("field_mask", ctypes.c_uint64),
        ("address", ctypes.c_void_p),
        ("length", ctypes.c_size_t),
        ("flags", ctypes.c_uint),
        ("prot", ctypes.c_uint),
        ("memory_type", ctypes.c_int),
        ("exported_memh_buffer", ctypes.c_void_p),
    )


class _Rma:
    """The libucp functions this module calls, declared with their C signatures."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, size, u64, status = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_int8
        param = ctypes.POINTER(_RequestParam)
        self.mem_map = _declared(lib.ucp_mem_map, status, ptr, ctypes.POINTER(_MemMapParams), ctypes.POINTER(ptr))
        self.mem_unmap = _declared(lib.ucp_mem_unmap, status, ptr, ptr)
        self.rkey_pack = _declared(lib.ucp_rkey_pack, status, ptr, ptr, ctypes.POINTER(ptr), ctypes.POINTER(size))
        self.rkey_buffer_release = _declared(lib.ucp_rkey_buffer_release, None, ptr)
        self.rkey_unpack = _declared(lib.ucp_ep_rkey_unpack, status, ptr, ctypes.c_char_p, ctypes.POINTER(ptr))
        self.rkey_destroy = _declared(lib.ucp_rkey_destroy, None, ptr)
        self.put_nbi = _declared(lib.ucp_put_nbi, status, ptr, ptr, size, u64, ptr)
        self.put_nbi_address = ctypes.cast(self.put_nbi, ptr).value
        loops = native.library()
        self.put_all = None if loops is None else _declared(
            loops.omni_put_all, ctypes.c_int, ptr, ptr, ptr, size
        )
        self.flush = _declared(lib.ucp_ep_flush_nbx, ptr, ptr, param)


@functools.cache
def _rma() -> _Rma:
    return _Rma(library())


class Registration:
    """The regions of a set mapped into a UCX context (``context``: a ucxx context, kept alive
    until :meth:`close`), and their packed remote keys, in region order."""

    def __init__(self, context: Any, arrays: Sequence[npt.NDArray[Any]]) -> None:
        self._context = context
        self._handles: list[int] = []
        keys: list[bytes] = []
        try:
            for array in arrays:
                handle = _map(context.handle, int(array.__array_interface__["data"][0]), int(array.nbytes))
                self._handles.append(handle)
                keys.append(_pack(context.handle, handle))
        except BaseException:
            self.close()
            raise
        self.keys: tuple[bytes, ...] = tuple(keys)
        """The packed remote key of each region, for the peers' :meth:`~.lane.Lane.unpack_keys`."""

    def close(self) -> None:
        """Unmap the regions (idempotent).  Only once no peer's lane can put into them.  Every
        region is unmapped even if one fails (then the first failure is raised after)."""
        handles, self._handles = self._handles, []
        failed = UCS_OK
        for handle in handles:
            code = _rma().mem_unmap(self._context.handle, handle)
            if code != UCS_OK and failed == UCS_OK:  # nothing to undo: UCX keeps nothing of a failed unmap
                failed = code
        if failed != UCS_OK:
            raise error(failed)


def _map(context: int, address: int, length: int) -> int:
    params = _MemMapParams(
        field_mask=_UCP_MEM_MAP_PARAM_FIELD_ADDRESS | _UCP_MEM_MAP_PARAM_FIELD_LENGTH, address=address, length=length
    )
    handle = ctypes.c_void_p()
    code = _rma().mem_map(context, ctypes.byref(params), ctypes.byref(handle))
    if code != UCS_OK:
        raise error(code)
    return int(handle.value or 0)


def _pack(context: int, handle: int) -> bytes:
    buffer, size = ctypes.c_void_p(), ctypes.c_size_t()
    code = _rma().rkey_pack(context, handle, ctypes.byref(buffer), ctypes.byref(size))
    if code != UCS_OK:
        raise error(code)
    try:
        return ctypes.string_at(buffer.value or 0, size.value)
    finally:
        _rma().rkey_buffer_release(buffer)


_KEY_SLACK: Final = 1 << 15
"""Zero bytes after a packed key handed to UCX, which reads as far as the key's own sizes say
(measured: a 4-byte prefix of a real key is accepted): at most 9 bytes plus 256 per memory
domain, so a short key makes it read zeros, never past the buffer."""


def unpack_key(endpoint: int, packed: bytes) -> int:
    """A remote key for ``endpoint`` from a peer's packed key; destroy it with :func:`destroy_key`
    before the endpoint's worker.  UCX trusts ``packed``: vet a peer's bytes in a child first."""
    key = ctypes.c_void_p()
    code = _rma().rkey_unpack(endpoint, packed + bytes(_KEY_SLACK), ctypes.byref(key))
    if code != UCS_OK:
        raise error(code)
    return int(key.value or 0)


def destroy_key(key: int) -> None:
    _rma().rkey_destroy(key)


def puts_of_runs(
    arrays: Sequence[npt.NDArray[np.uint8]], runs: Sequence[Run], bases: Sequence[int], keys: Sequence[int]
) -> npt.NDArray[np.uint64]:
    """``[local address, length, remote address, key]`` of each run's rows in every region (run
    by run, region by region; a ``(puts, 4)`` array): ``arrays`` are ours (2-D, C-contiguous),
    ``bases`` the peer's region addresses and ``keys`` their unpacked keys, in the same order.
    Computed from addresses and row lengths, with no view per row (256 one-block runs: one
    array pass, not 256 views and 256 address look-ups)."""
    table = run_table(runs)
    puts = np.empty((len(runs), len(arrays), 4), np.uint64)
    fill_local_rows(puts, arrays, table)  # the local rows, as a gathered message names them
    for i, (array, base, key) in enumerate(zip(arrays, bases, keys, strict=True)):
        puts[:, i, 2] = np.uint64(base) + table[:, 1] * np.uint64(array.shape[1])
        puts[:, i, 3] = key
    return puts.reshape(-1, 4)


def put_all(endpoint: int, puts: npt.NDArray[np.uint64]) -> None:
    """Post a put per row of ``puts`` (:func:`puts_of_runs`; ``ucp_put_nbi``: no request to
    track, a later :func:`flush` covers them), in one call of the C library where it is built
    (:mod:`.native`), else one ctypes call each.  The local bytes must stay unchanged until that
    flush completes.  Raises :class:`OSError` with UCX's reason at the first put UCX refuses
    (the ones before it stay posted)."""
    rma = _rma()
    if rma.put_all is not None:
        status = rma.put_all(rma.put_nbi_address, endpoint, puts.ctypes.data, len(puts))
    else:
        put, status = rma.put_nbi, 0
        for local, length, remote, key in puts.tolist():
            status = put(endpoint, local, length, remote, key)
            if status < 0:
                break
    if status < 0:
        raise error(status)


def flush(endpoint: int) -> int:
    """Post a flush of ``endpoint``: once it completes, every put posted before it is in the
    peer's memory.  A request to poll, or 0 if done."""
    return _checked(_rma().flush(endpoint, _CONTIG_REF))

