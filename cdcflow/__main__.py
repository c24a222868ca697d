"""``python -m cdcflow``: the cdcflow command line."""

import sys

from cdcflow.cli import main

if __name__ == "__main__":
    sys.exit(main())
