"""``python -m omni_async.cli``: the same as the ``omni-async`` console script."""

import sys

from . import main

sys.exit(main())
