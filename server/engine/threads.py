"""Intra-op threads of a CPU engine: one per physical core this process may run on.

A second hardware thread of a core adds no arithmetic to these matmuls, and an engine that
takes every logical CPU leaves the HTTP front end none. The caller's OMP_NUM_THREADS wins.
"""

import logging
import os

import torch

log = logging.getLogger(__name__)


def physical_cores() -> int:
    """Distinct (package, core) pairs among the CPUs in this process's affinity mask."""
    try:
        cpus = os.sched_getaffinity(0)
    except AttributeError:                         # not Linux
        return max(1, (os.cpu_count() or 2) // 2)
    cores = set()
    for cpu in cpus:
        topology = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{topology}/physical_package_id") as f, open(f"{topology}/core_id") as g:
                cores.add((f.read().strip(), g.read().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return min(len(cores) or len(cpus), cgroup_cpu_limit() or len(cpus))


def cgroup_cpu_limit() -> int | None:
    """CPUs a container's cgroup v2 quota allows (rounded up), or None without a quota."""
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:  # "<quota> <period>" or "max <period>"
            quota, period = f.read().split()
        return None if quota == "max" else max(1, -(-int(quota) // int(period)))
    except (OSError, ValueError):
        return None


def configure_cpu_threads() -> int:
    """Sets torch's intra-op threads (unless OMP_NUM_THREADS says) and returns their number."""
    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(physical_cores())
    threads = torch.get_num_threads()
    log.info("CPU threads: %d intra-op (OMP_WAIT_POLICY=%s)", threads, os.environ.get("OMP_WAIT_POLICY", "default"))
    return threads
