"""``python -m amp_rewrite``: the ``amp-rewrite`` command."""

import sys

from .cli import main

sys.exit(main())
