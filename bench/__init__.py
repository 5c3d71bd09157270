"""Benchmarks of omni_async side by side with numpy memcpy (the limit) and NIXL.

Run ``python -m bench blocks`` (block writes), ``python -m bench idle`` (CPU of an idle
connected pair).  Every number comes from processes this package starts and always stops.
"""

import os as _os

CLEAN_ENV: dict[str, str] = dict(_os.environ)
"""The environment before anything imported ucxx, which adds ``UCX_RNDV_THRESH``,
``UCX_RNDV_FRAG_MEM_TYPE`` and ``UCX_MAX_RNDV_RAILS`` to ``os.environ``: children start from this
copy, so NIXL's processes are not tuned by ucxx's import."""
