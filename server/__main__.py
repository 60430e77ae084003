"""``python -m server``: see ``server/cli.py``."""

import os
import sys

# Idle OpenMP threads of the engine sleep at once instead of spinning: a spinning pool on a CPU
# that other processes also use made decode steps 100x slower (docs/cpu.md, Threads). Read once,
# when OpenMP loads, so set before anything imports torch; the processes started inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from server.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
