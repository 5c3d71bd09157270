"""omni_async's loops in C (``_native.c``), built at install where a C compiler is there.

A plain C library (no Python API) loaded with ctypes, which releases the GIL around each call:
:mod:`.memcopy` copies a write's runs of rows with it and :mod:`.rma` posts a write's puts.
The extension is optional: where it was not built (or is from another version of these
functions), :func:`library` is None, one warning is logged, and those modules do the same work
in Python.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
from typing import Final

log = logging.getLogger(__name__)

VERSION: Final = 2
"""The library's ``omni_native_version()`` this package was written for (another: not used)."""


@functools.cache
def library() -> ctypes.CDLL | None:
    """The C library, loaded on first use; None where it is not built or not this version."""
    spec = importlib.util.find_spec(f"{__package__}._native")
    if spec is None or spec.origin is None:
        log.warning("omni_async's C loops are not built (no C compiler at install?): doing their work in Python")
        return None
    try:
        lib = ctypes.CDLL(spec.origin)
    except OSError as exc:
        log.warning("omni_async's C loops at %s cannot be loaded (%s): doing their work in Python", spec.origin, exc)
        return None
    version = getattr(lib, "omni_native_version", None)
    if version is None or version() != VERSION:
        log.warning("omni_async's C loops at %s are from another version (reinstall): doing their work in Python",
                    spec.origin)
        return None
    return lib


def built() -> bool:
    """Whether the C library is there (and this version)."""
    return library() is not None
