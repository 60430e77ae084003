"""Whether a CPU decode step runs its matmuls on every intra-op thread or everything on one,
chosen by timing both as the server runs.

With OpenMP's default wait (an idle pool thread spins a few milliseconds, then sleeps) a decode
step on the 2 cores of this team's host is about 20 % faster on both threads than on one. But
while another process holds a core, the spinning threads wait for each other at every parallel
region and the step runs three times slower than on one thread (docs/cpu.md, Threads). Neither
choice is right for every host, and the host changes while the server runs, so the engine
measures: decode steps run in the mode that was faster when the two were last compared. Every
``interval`` steps, ``PROBE_STEPS`` steps run in the other mode, and their median time is
compared with the median of the last steps in the current mode at the same batch size (a probe
step twice as slow ends the probe at once: all threads on a contended host). A comparison that
keeps the mode doubles the interval (up to ``MAX_INTERVAL``: a probe then costs well under 1 % of
the steps); a switch resets it to ``MIN_INTERVAL``. Between decode steps (prefills, the engine's
sampling) the process keeps the chosen mode's thread count.
"""

import logging
import statistics

import torch

log = logging.getLogger(__name__)

ALL_THREADS, ONE_THREAD = "all threads", "one thread"


class ThreadChooser:
    PROBE_STEPS = 3
    GIVE_UP = 2.0              # a probe step this many times slower than the current mode ends the probe
    MIN_INTERVAL = 16
    MAX_INTERVAL = 1024

    def __init__(self, threads: int, pinned: str | None = None):
        """``pinned``: every decode step in that mode, none timed (tests; a host known to be shared)."""
        if pinned not in (None, ALL_THREADS, ONE_THREAD):
            raise ValueError(f"pinned {pinned!r} is not one of {ALL_THREADS!r}, {ONE_THREAD!r} or None")
        self.threads = threads
        self.pinned = pinned
        self.mode = pinned or ALL_THREADS
        self.interval = self.PROBE_STEPS          # the first comparison right after the first steps
        self._since_probe = 0
        self._recent: list[tuple[int, float]] = []   # (batch, seconds) of the last steps in self.mode
        self._probe_batch: int | None = None
        self._probe: list[float] = []

    def apply(self) -> None:
        """Sets the process's intra-op threads for what runs between decode steps (prefills, the
        engine's sampling): all of them, or one, so that in one-thread mode no parallel region
        leaves the pool's threads spinning on a core another process needs."""
        torch.set_num_threads(self.threads if self.mode == ALL_THREADS else 1)

    @property
    def other(self) -> str:
        return ONE_THREAD if self.mode == ALL_THREADS else ALL_THREADS

    def choose(self, batch: int) -> str:
        """The mode of the next decode step of ``batch`` sequences."""
        if self.pinned is not None:
            return self.pinned
        if self._probe_batch is not None and batch != self._probe_batch:
            self._probe_batch = None                  # the batch changed mid-probe: times no longer compare
            self._since_probe = 0
        if (self._probe_batch is None and self._since_probe >= self.interval
                and len(self._recent) == self.PROBE_STEPS and all(b == batch for b, _ in self._recent)):
            self._probe_batch, self._probe = batch, []
        return self.other if self._probe_batch is not None else self.mode

    def record(self, mode: str, batch: int, seconds: float) -> None:
        """A decode step of ``batch`` sequences that ran in ``mode`` took ``seconds``."""
        if self.pinned is not None:
            return
        if mode == self.mode:
            self._recent = (self._recent + [(batch, seconds)])[-self.PROBE_STEPS:]
            self._since_probe += 1
            return
        self._probe.append(seconds)
        current = statistics.median(s for _, s in self._recent)
        if len(self._probe) < self.PROBE_STEPS and seconds < self.GIVE_UP * current:
            return
        probe = statistics.median(self._probe)
        if len(self._probe) == self.PROBE_STEPS and probe < current:
            log.info("CPU decode steps now on %s: %.1f ms a step at batch %d, against %.1f ms on %s",
                     self.other, probe * 1e3, batch, current * 1e3, self.mode)
            self.mode = self.other
            self._recent = [(batch, s) for s in self._probe]
            self.interval = self.MIN_INTERVAL
        else:
            self.interval = min(max(2 * self.interval, self.MIN_INTERVAL), self.MAX_INTERVAL)
        self._probe_batch, self._since_probe = None, 0
