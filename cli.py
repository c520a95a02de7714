"""Run amp-rewrite from a source checkout: ``python cli.py model.pb -o model_amp.pb``."""

import sys

from amp_rewrite.cli.run import main

if __name__ == "__main__":
    sys.exit(main())
