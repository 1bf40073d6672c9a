"""`python -m minips ...` runs the command line (see minips/cli.py)."""

import sys

from minips.cli import main

__all__: list[str] = []

sys.exit(main())
