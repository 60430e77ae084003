"""N local replicas of the server behind the SGLang Model Gateway (``sglang-router``), for development.

    python -m load_tests.replicas --replicas 2 --port 30000 -- --model random:tiny
    make replicas N=2 MODEL=random:tiny

Replica i listens on 127.0.0.1:(--first-port + i) (with ``--gpus 0,1``, on the GPU named i-th, through
CUDA_VISIBLE_DEVICES), the router on --port. Everything after ``--`` goes to every replica's
``python -m server``. Ctrl-C (or SIGTERM) stops the router, then drains the replicas. Logs are
written to --log-dir. The tests start replicas and the router through the same classes, with the
same router flags (ROUTER_FLAGS) as the Compose profile ``router`` and the Kubernetes manifests.
"""

import argparse
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import httpx

# power_of_two is left out: it polls an SGLang-only /get_load that this server does not answer.
POLICIES = ("cache_aware", "round_robin", "random")

# The gateway's defaults notice a dead or draining replica only after 3 failed health checks 60 s
# apart, and open a replica's circuit breaker after 10 failed responses, counting 4xx answers
# (a client naming an unknown model) as failures. Here a replica is out after one failed check
# (1 s apart) and back after one good one; retries (a refused connection, 503 while draining or
# loading, 429 when its queue is full) back off from 200 ms for about 10 s, which covers the checks
# that take a replica out; the circuit breaker stays off.
ROUTER_FLAGS = (
    "--health-check-endpoint", "/health",
    "--health-check-interval-secs", "1",
    "--health-failure-threshold", "1",
    "--health-success-threshold", "1",
    "--retry-max-retries", "8",
    "--retry-initial-backoff-ms", "200",
    "--retry-max-backoff-ms", "3000",
    "--disable-circuit-breaker",
)


def router_executable() -> str:
    """The ``sglang-router`` script installed beside this interpreter (or on PATH)."""
    candidate = Path(sysconfig.get_path("scripts")) / "sglang-router"
    return str(candidate) if candidate.exists() else "sglang-router"


def router_command(worker_urls: list[str], *, port: int, policy: str = "cache_aware",
                   host: str = "127.0.0.1", prometheus_port: int | None = None,
                   log_level: str = "warn", extra: tuple[str, ...] = ()) -> list[str]:
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r} is not one of {POLICIES}")
    if not worker_urls:
        raise ValueError("the router needs at least one worker URL")
    cmd = [router_executable(), "launch", "--host", host, "--port", str(port), "--policy", policy,
           "--worker-urls", *worker_urls, "--log-level", log_level, *ROUTER_FLAGS]
    if prometheus_port is not None:
        cmd += ["--prometheus-host", host, "--prometheus-port", str(prometheus_port)]
    return cmd + list(extra)


class Process:
    """One child process with its log file; ``url`` is where it answers HTTP."""

    def __init__(self, name: str, cmd: list[str], url: str, log_dir: Path, env: dict | None = None):
        self.name, self.cmd, self.url = name, cmd, url
        self.log_path = log_dir / f"{name}.log"
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Process":
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds; the exit status."""
        if self.proc is None:
            return None
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def wait_until(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before {what}:\n"
                                   f"{self.log_tail()}")
            try:
                if ready():
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"{self.name}: not {what} after {timeout:.0f} s:\n{self.log_tail()}")


def replica(index: int, port: int, server_args: list[str], log_dir: Path, gpu: str | None = None) -> Process:
    env = {"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else None
    cmd = [sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(port), *server_args]
    return Process(f"replica-{index}", cmd, f"http://127.0.0.1:{port}", log_dir, env)


def wait_healthy(server: Process, timeout: float) -> None:
    server.wait_until(lambda: httpx.get(server.url + "/health", timeout=2).status_code == 200,
                      timeout, "healthy")


def router_workers(router_url: str) -> dict[str, dict]:
    """The router's view of its workers, by URL."""
    return {w["url"]: w for w in httpx.get(router_url + "/workers", timeout=5).json()["workers"]}


def wait_router_ready(router: Process, worker_urls: list[str], timeout: float) -> None:
    """Until the router lists every worker healthy and under a model name (not ``unknown``)."""
    def ready() -> bool:
        workers = router_workers(router.url)
        return all(url in workers and workers[url]["is_healthy"] and workers[url]["model_id"] != "unknown"
                   for url in worker_urls)
    router.wait_until(ready, timeout, "routing to every replica")


def start_router(worker_urls: list[str], port: int, log_dir: Path, *, policy: str = "cache_aware",
                 prometheus_port: int | None = None, timeout: float = 60.0) -> Process:
    cmd = router_command(worker_urls, port=port, policy=policy, prometheus_port=prometheus_port)
    router = Process(f"router-{policy}-{port}", cmd, f"http://127.0.0.1:{port}", log_dir).start()
    try:
        wait_router_ready(router, worker_urls, timeout)
    except BaseException:
        router.stop(timeout=5)
        raise
    return router


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    server_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m load_tests.replicas", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--port", type=int, default=30000, help="the router's port")
    p.add_argument("--first-port", type=int, default=8001, help="replica i listens on this + i")
    p.add_argument("--policy", choices=POLICIES, default="cache_aware")
    p.add_argument("--prometheus-port", type=int, default=29000, help="the router's own metrics")
    p.add_argument("--gpus", default=None, help="comma-separated GPU ids, one per replica in turn")
    p.add_argument("--log-dir", default="results/replicas")
    p.add_argument("--start-timeout", type=float, default=900.0)
    args = p.parse_args(own)
    if args.replicas < 1:
        p.error(f"--replicas must be at least 1, got {args.replicas}")
    gpus = args.gpus.split(",") if args.gpus else None
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)

    replicas = [replica(i, args.first_port + i, server_args, log_dir, gpus[i % len(gpus)] if gpus else None)
                for i in range(args.replicas)]
    router = None
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    try:
        for r in replicas:
            r.start()
        for r in replicas:
            wait_healthy(r, args.start_timeout)
        router = start_router([r.url for r in replicas], args.port, log_dir, policy=args.policy,
                              prometheus_port=args.prometheus_port)
        print(f"router {router.url} ({args.policy}) -> " + " ".join(r.url for r in replicas)
              + f"; logs in {log_dir}; Ctrl-C stops", flush=True)
        while not stop["now"]:
            for proc in (router, *replicas):
                if not proc.alive():
                    print(f"{proc.name} exited with {proc.proc.returncode}; stopping", file=sys.stderr)
                    return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        if router is not None:
            router.stop(timeout=10)
        for r in replicas:
            r.signal(signal.SIGTERM)
        for r in replicas:
            r.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
