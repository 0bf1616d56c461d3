"""`python -m minisgl ...` and the `minisgl` console script: the command line is frontend/cli.py."""

import sys

from .frontend.cli import main

if __name__ == "__main__":
    sys.exit(main())
