"""`python -m minips ...` runs the command line (see minips/run/cli.py)."""

import sys

from minips.run.cli import main

__all__: list[str] = []

sys.exit(main())
