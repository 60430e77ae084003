"""The Python half of docker/ci.sh: checks of a running server container as its user sees it, a
check of the GPU image from inside, and the CUDA toolkit laid out from PyPI's wheels.

    python docker/ci.py healthy CONTAINER            healthy within the health check's start period
    python docker/ci.py chat BASE_URL                the OpenAI client's chat answer names Paris
    python docker/ci.py drain BASE_URL CONTAINER     a stream in flight across `docker stop` ends whole, exit 0
    python docker/ci.py compose CONTAINER CONFIG SERVICE   the container has the Compose file's settings
    python - kernel-ops < docker/ci.py               (in the GPU image) the built kernel loads, its ops resolve
    python docker/ci.py cuda-layout WHEELS FOLDER    the nvidia-* wheels' trees merged into one CUDA_HOME

Each check prints one line on success and exits 1 with the reason otherwise. The docker CLI is
$DOCKER (default `docker`), talking to $DOCKER_HOST.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

DOCKER = os.environ.get("DOCKER", "docker")
NS = 1_000_000_000


class CheckFailed(Exception):
    pass


def docker(*args: str, timeout: float = 120) -> str:
    proc = subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise CheckFailed(f"docker {' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def inspect(container: str) -> dict:
    return json.loads(docker("inspect", container))[0]


def healthy(container: str) -> str:
    """Docker's own health status turns healthy before the start period has passed."""
    config = inspect(container)["Config"].get("Healthcheck") or {}
    if not config.get("Test") or config["Test"][0] == "NONE":
        raise CheckFailed(f"{container} has no health check")
    start_period = config.get("StartPeriod", 0) / NS
    if start_period <= 0:
        raise CheckFailed(f"{container}'s health check has no start period")
    name = inspect(container)["Name"].lstrip("/")
    started = time.monotonic()
    while True:
        state = inspect(container)["State"]
        status = (state.get("Health") or {}).get("Status")
        waited = time.monotonic() - started
        if status == "healthy":
            return f"{name}: healthy after {waited:.0f} s (start period {start_period:.0f} s)"
        if not state["Running"]:
            raise CheckFailed(f"{container} exited with status {state['ExitCode']} before it was healthy")
        if status == "unhealthy":
            raise CheckFailed(f"{container} turned unhealthy after {waited:.0f} s")
        if waited > start_period:
            raise CheckFailed(f"{container} not healthy within its start period of {start_period:.0f} s "
                              f"(status {status})")
        time.sleep(1)


def chat(base_url: str) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key=os.environ.get("OPENAI_API_KEY", "none"), timeout=120)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model, temperature=0, max_tokens=32,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    answer = reply.choices[0].message.content or ""
    if "Paris" not in answer:
        raise CheckFailed(f"the chat answer does not name Paris: {answer!r}")
    return f"chat ({model}): {answer.strip()!r}"


def sse_events(response):
    for line in response.iter_lines():
        if line.startswith("data:"):
            yield json.loads(line[len("data:"):])


def drain(base_url: str, container: str, new_tokens: int, stop_timeout: int) -> str:
    """A /generate_stream request is running when `docker stop` sends SIGTERM; the server lets it
    finish (its last event carries generated_text and details), then exits with status 0."""
    import httpx

    stop: dict = {}

    def stop_container():
        stop["sent"] = time.monotonic()
        proc = subprocess.run([DOCKER, "stop", "-t", str(stop_timeout), container],
                              capture_output=True, text=True, timeout=stop_timeout + 60)
        stop["returned"] = time.monotonic()
        stop["rc"], stop["stderr"] = proc.returncode, proc.stderr.strip()

    stopper = threading.Thread(target=stop_container)
    body = {"inputs": "Write a long story about a lighthouse keeper.",
            "parameters": {"max_new_tokens": new_tokens, "ignore_eos": True, "details": True,
                           "do_sample": False}}
    tokens_after_stop, last, stopping = 0, None, False
    with httpx.stream("POST", f"{base_url}/generate_stream", json=body, timeout=stop_timeout + 60) as response:
        if response.status_code != 200:
            raise CheckFailed(f"/generate_stream answered {response.status_code}: {response.read()!r}")
        for event in sse_events(response):
            if "error" in event:
                raise CheckFailed(f"the stream was cut by the stop: {event}")
            last = event
            if not stopping:
                stopper.start()             # after the first token: the request is running
                stopping = True
            elif "sent" in stop:
                tokens_after_stop += 1
    stopper.join()
    if last is None or last.get("generated_text") is None or last.get("details") is None:
        raise CheckFailed(f"the stream ended without its final event (last event: {last})")
    generated = last["details"]["generated_tokens"]
    if generated != new_tokens or last["index"] != new_tokens:
        raise CheckFailed(f"the stream ended after {generated} of {new_tokens} tokens: {last['details']}")
    if tokens_after_stop == 0:
        raise CheckFailed("no token arrived after `docker stop` was sent: the stream was not in flight")
    if stop.get("rc") != 0:
        raise CheckFailed(f"docker stop failed: {stop.get('stderr')}")
    state = inspect(container)["State"]
    if state["Running"] or state["ExitCode"] != 0 or state.get("OOMKilled"):
        raise CheckFailed(f"{container} after the drain: running={state['Running']} "
                          f"exit status {state['ExitCode']} oom={state.get('OOMKilled')}")
    return (f"drain: {tokens_after_stop} of {new_tokens} tokens streamed after SIGTERM, final event "
            f"finish_reason={last['details']['finish_reason']}; docker stop took "
            f"{stop['returned'] - stop['sent']:.1f} s; exit status 0")


def duration_ns(value: str | int | None) -> int | None:
    """Compose's config prints durations as Go does (1m30s, 45s, 500ms) or as nanoseconds."""
    if value is None or isinstance(value, int):
        return value
    units = {"h": 3600 * NS, "m": 60 * NS, "s": NS, "ms": NS // 1000, "us": 1000, "ns": 1}
    parts = re.findall(r"([\d.]+)(h|ms|us|ns|m|s)", value)
    if not parts or "".join(n + u for n, u in parts) != value:
        raise CheckFailed(f"cannot read the duration {value!r}")
    return round(sum(float(n) * units[u] for n, u in parts))


def compose(container: str, config_path: str, service: str) -> str:
    """The running container's health check, model volume and stop grace period are the Compose
    file's (read from `docker compose config --format json`, variables resolved)."""
    with open(config_path) as f:
        config = json.load(f)
    want = config["services"][service]
    got = inspect(container)
    problems = []

    check = want["healthcheck"]
    have = got["Config"].get("Healthcheck") or {}
    for key, compose_key in (("Interval", "interval"), ("Timeout", "timeout"), ("StartPeriod", "start_period")):
        if have.get(key) != duration_ns(check.get(compose_key)):
            problems.append(f"healthcheck {compose_key}: container {have.get(key)} ns, compose {check.get(compose_key)}")
    if have.get("Retries") != check.get("retries"):
        problems.append(f"healthcheck retries: container {have.get('Retries')}, compose {check.get('retries')}")
    if have.get("Test") != check.get("test"):
        problems.append(f"healthcheck test: container {have.get('Test')}, compose {check.get('test')}")

    for volume in want.get("volumes", []):
        if volume.get("type") != "volume":
            continue
        name = config["volumes"][volume["source"]].get("name", volume["source"])
        mounts = [m for m in got["Mounts"] if m.get("Destination") == volume["target"]]
        if not mounts or mounts[0].get("Type") != "volume" or mounts[0].get("Name") != name:
            problems.append(f"volume {name} at {volume['target']}: container mounts {mounts}")

    grace = duration_ns(want.get("stop_grace_period"))
    stop_timeout = got["Config"].get("StopTimeout")
    if grace is None or stop_timeout is None or stop_timeout * NS != grace:
        problems.append(f"stop grace period: container {stop_timeout} s, compose {want.get('stop_grace_period')}")
    if problems:
        raise CheckFailed("; ".join(problems))
    return (f"compose {service}: health check {check['interval']}/{check['timeout']}/{check['retries']} "
            f"start period {check['start_period']}, volume {name} at {volume['target']}, "
            f"stop grace period {stop_timeout} s")


def kernel_ops() -> str:
    """Run in the GPU image as its user: the extension compiled while the image was built loads
    without being compiled again, and each op the library defines has a CUDA kernel."""
    import torch

    import kernels
    from kernels import build

    library = Path(build.cache_dir()) / f"{build.EXTENSION_NAME}.so"
    if not library.is_file():
        raise CheckFailed(f"the image has no built kernel at {library}")
    built_at = library.stat().st_mtime_ns
    started = time.monotonic()
    build.load_extension(require_device=False)
    took = time.monotonic() - started
    if library.stat().st_mtime_ns != built_at:
        raise CheckFailed("loading the kernel compiled it again: the image's build is not up to date")
    defined = [name for name in torch._C._dispatch_get_all_op_names() if name.startswith("flashdecode::")]
    if not defined:
        raise CheckFailed("the library registered no flashdecode ops")
    missing = [name for name in defined if not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA")]
    if missing:
        raise CheckFailed(f"ops without a CUDA kernel: {missing}")
    for name in defined:
        getattr(torch.ops.flashdecode, name.split("::", 1)[1].split(".")[0])
    return (f"kernels ({Path(kernels.__file__).parent}): {library} loaded in {took:.1f} s without a rebuild; "
            f"torch {torch.__version__} (CUDA {torch.version.cuda}); {len(defined)} ops with CUDA kernels: "
            + ", ".join(sorted(n.split("::", 1)[1] for n in defined)))


def cuda_layout(wheels: Path, top: Path) -> str:
    """PyPI's nvidia-* wheels each hold part of one tree (nvidia/cuXX/bin, include, lib, nvvm):
    merged, that tree is a CUDA_HOME as nvcc and torch's extension builder expect it."""
    count = 0
    for wheel in sorted(wheels.glob("nvidia_*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            for info in archive.infolist():
                parts = info.filename.split("/")
                if info.is_dir() or parts[0] != "nvidia" or len(parts) < 4 or parts[2].startswith("."):
                    continue
                target = top.joinpath(*parts[2:])
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(archive.read(info))
                executable = (info.external_attr >> 16) & 0o111 or "bin" in parts[2:-1]
                target.chmod(0o755 if executable else 0o644)
                count += 1
    if not (top / "bin" / "nvcc").is_file():
        raise CheckFailed(f"no bin/nvcc in the wheels of {wheels}")
    return f"{count} files from {len(list(wheels.glob('nvidia_*.whl')))} wheels in {top}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="check", required=True)
    sub.add_parser("healthy").add_argument("container")
    sub.add_parser("chat").add_argument("base_url")
    p = sub.add_parser("drain")
    p.add_argument("base_url")
    p.add_argument("container")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--stop-timeout", type=int, default=45)
    p = sub.add_parser("compose")
    p.add_argument("container")
    p.add_argument("config")
    p.add_argument("service")
    sub.add_parser("kernel-ops")
    p = sub.add_parser("cuda-layout")
    p.add_argument("wheels", type=Path)
    p.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.check == "healthy":
            print(healthy(args.container))
        elif args.check == "chat":
            print(chat(args.base_url))
        elif args.check == "drain":
            print(drain(args.base_url, args.container, args.new_tokens, args.stop_timeout))
        elif args.check == "compose":
            print(compose(args.container, args.config, args.service))
        elif args.check == "kernel-ops":
            print(kernel_ops())
        else:
            print(cuda_layout(args.wheels, args.folder))
    except (CheckFailed, OSError, subprocess.TimeoutExpired) as error:
        print(f"FAILED {args.check}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
