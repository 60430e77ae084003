"""The CPU seconds (user and system) a process and its descendants have used so far, from /proc
(Linux): what a server spent on a load, read before and after it.

    python -m load_tests.process_cpu PID
"""

import os
import sys


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds of ``root`` and every live descendant (children that exited are not counted)."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()     # after the command, which may hold spaces
        except OSError:                                          # gone meanwhile
            continue
        pid = int(name)
        children.setdefault(int(fields[1]), []).append(pid)      # ppid
        ticks[pid] = int(fields[11]) + int(fields[12])           # utime + stime
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += ticks.get(pid, 0)
        todo += children.get(pid, [])
    return total / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    print(f"{tree_cpu_seconds(int(sys.argv[1])):.2f}")
