"""``python -m server``: see ``server/cli.py``."""

import sys

from server.cli import main

if __name__ == "__main__":
    sys.exit(main())
