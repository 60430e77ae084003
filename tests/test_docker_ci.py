"""docker/ci.sh and docker/ci.py without a Docker engine: the script's interface and promises, the
Compose check against container descriptions that agree and disagree, Go durations, and the CUDA
tree laid out from wheels. The script itself runs with `make docker-test` (root, Debian)."""

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docker"))
import ci  # noqa: E402  (docker/ci.py)

SCRIPT = ROOT / "docker" / "ci.sh"
NS = 1_000_000_000


def test_script_parses_and_refuses_unknown_arguments():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    proc = subprocess.run(["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "usage" in proc.stderr


def test_script_names_no_mirror_and_cleans_up_on_every_exit():
    text = SCRIPT.read_text()
    # The Debian mirror comes from apt's configuration, never from the repository.
    assert "apt-get indextargets" in text
    for host in ("debian.org", "pypi.org", "pytorch.org", "docker.io/", "http://", "https://"):
        assert host not in text.replace("http://127.0.0.1", ""), host
    assert "trap cleanup EXIT" in text and "--iptables=false" in text and "--bridge none" in text


@pytest.mark.parametrize("dockerfile", sorted((ROOT / "docker").glob("Dockerfile*")), ids=lambda p: p.name)
def test_dockerfiles_build_without_a_registry_front_end(dockerfile):
    """No `# syntax=` directive (BuildKit would fetch that front end from a registry), and the base
    is an ARG whose default is an official image, so CI can substitute its own."""
    lines = dockerfile.read_text().splitlines()
    assert not any(line.replace(" ", "").lower().startswith("#syntax=") for line in lines)
    (from_line,) = [line for line in lines if line.startswith("FROM ")]
    arg = from_line.split("${", 1)[1].split("}", 1)[0]
    (default,) = [line.split("=", 1)[1] for line in lines if line.startswith(f"ARG {arg}=")]
    assert default.startswith(("python:", "nvidia/cuda:")), default


@pytest.mark.parametrize("text, ns", [("45s", 45 * NS), ("1m30s", 90 * NS), ("500ms", NS // 2),
                                      ("2m", 120 * NS), ("1h", 3600 * NS), (15 * NS, 15 * NS)])
def test_go_durations(text, ns):
    assert ci.duration_ns(text) == ns


@pytest.mark.parametrize("text", ["45", "forty", "1m 30s"])
def test_go_durations_refuse_what_they_cannot_read(text):
    with pytest.raises(ci.CheckFailed):
        ci.duration_ns(text)


COMPOSE_CONFIG = {
    "services": {"server-cpu": {
        "healthcheck": {"test": ["CMD", "python", "-c", "probe"], "interval": "15s", "timeout": "5s",
                        "retries": 3, "start_period": "2m0s"},
        "volumes": [{"type": "volume", "source": "model-cache", "target": "/var/cache/flashdecode/models"}],
        "stop_grace_period": "45s"}},
    "volumes": {"model-cache": {"name": "flashdecode-model-cache"}},
}


def container(**change):
    description = {
        "Config": {"Healthcheck": {"Test": ["CMD", "python", "-c", "probe"], "Interval": 15 * NS,
                                   "Timeout": 5 * NS, "Retries": 3, "StartPeriod": 120 * NS},
                   "StopTimeout": 45},
        "Mounts": [{"Type": "volume", "Name": "flashdecode-model-cache",
                    "Destination": "/var/cache/flashdecode/models"}],
    }
    for key, value in change.items():
        section, field = key.split("__")
        target = description["Config"] if section == "Config" else description["Config"]["Healthcheck"]
        target[field] = value
    return description


@pytest.fixture
def compose_config(tmp_path):
    path = tmp_path / "compose.json"
    path.write_text(json.dumps(COMPOSE_CONFIG))
    return str(path)


def test_compose_check_accepts_a_container_with_the_files_settings(monkeypatch, compose_config):
    monkeypatch.setattr(ci, "inspect", lambda name: container())
    assert "stop grace period 45 s" in ci.compose("c", compose_config, "server-cpu")


@pytest.mark.parametrize("change, named", [
    ({"Config__StopTimeout": 10}, "stop grace period"),       # Docker's default, not the file's
    ({"Health__StartPeriod": 300 * NS}, "start_period"),
    ({"Health__Retries": 5}, "retries"),
    ({"Health__Test": ["NONE"]}, "test"),
])
def test_compose_check_names_what_differs(monkeypatch, compose_config, change, named):
    monkeypatch.setattr(ci, "inspect", lambda name: container(**change))
    with pytest.raises(ci.CheckFailed, match=named):
        ci.compose("c", compose_config, "server-cpu")


def test_compose_check_needs_the_named_volume(monkeypatch, compose_config):
    other = container()
    other["Mounts"] = [{"Type": "bind", "Source": "/srv", "Destination": "/var/cache/flashdecode/models"}]
    monkeypatch.setattr(ci, "inspect", lambda name: other)
    with pytest.raises(ci.CheckFailed, match="volume flashdecode-model-cache"):
        ci.compose("c", compose_config, "server-cpu")


def fake_wheel(path: Path, files: dict[str, tuple[bytes, int]]) -> None:
    with zipfile.ZipFile(path, "w") as archive:
        for name, (data, mode) in files.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = mode << 16
            archive.writestr(info, data)


def test_cuda_layout_merges_the_wheels_into_one_tree(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    fake_wheel(wheels / "nvidia_cuda_nvcc-13.0.88-py3-none-any.whl", {
        "nvidia/cu13/bin/nvcc": (b"#!/bin/sh\n", 0),           # mode lost: bin/ makes it executable
        "nvidia/cu13/.metadata/sizes.txt": (b"", 0o644),
        "nvidia_cuda_nvcc-13.0.88.dist-info/METADATA": (b"", 0o644)})
    fake_wheel(wheels / "nvidia_cuda_runtime-13.0.96-py3-none-any.whl", {
        "nvidia/cu13/include/cuda_runtime.h": (b"//", 0o644),
        "nvidia/cu13/lib/libcudart.so.13": (b"\x7fELF", 0o755)})
    top = tmp_path / "usr/local/cuda-13.0"
    ci.cuda_layout(wheels, top)
    found = sorted(str(p.relative_to(top)) for p in top.rglob("*") if p.is_file())
    assert found == ["bin/nvcc", "include/cuda_runtime.h", "lib/libcudart.so.13"]
    assert (top / "bin/nvcc").stat().st_mode & 0o111
    assert not (top / "include/cuda_runtime.h").stat().st_mode & 0o111


def test_cuda_layout_refuses_wheels_without_a_compiler(tmp_path):
    fake_wheel(tmp_path / "nvidia_cuda_runtime-13.0.96-py3-none-any.whl",
               {"nvidia/cu13/lib/libcudart.so.13": (b"", 0o755)})
    with pytest.raises(ci.CheckFailed, match="nvcc"):
        ci.cuda_layout(tmp_path, tmp_path / "cuda")


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def states(*sequence):
    """A container whose State follows `sequence` (Health status or "exited:N") one poll at a time."""
    polls = iter(sequence)
    last = {}

    def inspect(name):
        nonlocal last
        item = next(polls, None)
        if item is not None:
            if item.startswith("exited:"):
                last = {"Running": False, "ExitCode": int(item.split(":")[1]), "Health": {"Status": "unhealthy"}}
            else:
                last = {"Running": True, "ExitCode": 0, "Health": {"Status": item}}
        description = container(Health__StartPeriod=10 * NS)
        return {**description, "Name": "/c", "State": last}
    return inspect


@pytest.mark.parametrize("sequence, error", [
    (["starting"] * 30, "not healthy within its start period of 10 s"),
    (["starting", "starting", "exited:1"], "exited with status 1"),
    (["starting", "unhealthy"], "turned unhealthy"),
])
def test_healthy_fails_a_container_that_does_not_turn_healthy(monkeypatch, sequence, error):
    clock = FakeClock()
    monkeypatch.setattr(ci, "time", clock)
    monkeypatch.setattr(ci, "inspect", states("starting", *sequence))
    with pytest.raises(ci.CheckFailed, match=error):
        ci.healthy("c")


def test_healthy_passes_within_the_start_period(monkeypatch):
    monkeypatch.setattr(ci, "time", FakeClock())
    monkeypatch.setattr(ci, "inspect", states("starting", "starting", "starting", "healthy"))
    assert re.fullmatch(r"c: healthy after \d+ s \(start period 10 s\)", ci.healthy("c"))


def sse_server(events: list[dict], delay: float = 0.05):
    """A /generate_stream that sends `events`, one every `delay` seconds."""
    import http.server
    import threading
    import time

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for event in events:
                self.wfile.write(f"data:{json.dumps(event)}\n\n".encode())
                self.wfile.flush()
                time.sleep(delay)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def token(index, final=None):
    return {"index": index, "token": {"id": index, "text": "x"}, "generated_text": final and "x" * index,
            "details": final and {"finish_reason": final, "generated_tokens": index}}


@pytest.mark.parametrize("events, error", [
    ([token(1), token(2), token(3), {"error": "the server is shutting down and ended the request after 3 tokens",
                                     "error_type": "incomplete_generation"}], "cut by the stop"),
    ([token(1), token(2), token(3)], "without its final event"),
    ([token(1), token(2), token(3, final="length")], "after 3 of 6 tokens"),
])
def test_drain_fails_a_stream_the_stop_cut(monkeypatch, events, error):
    monkeypatch.setattr(ci, "DOCKER", "true")       # `docker stop` succeeds at once
    monkeypatch.setattr(ci, "inspect", lambda name: {"State": {"Running": False, "ExitCode": 0}})
    server = sse_server(events)
    try:
        with pytest.raises(ci.CheckFailed, match=error):
            ci.drain(f"http://127.0.0.1:{server.server_port}", "c", new_tokens=6, stop_timeout=5)
    finally:
        server.shutdown()


@pytest.mark.parametrize("exit_code, error", [(0, None), (137, "exit status 137")])
def test_drain_needs_the_whole_stream_and_exit_status_0(monkeypatch, exit_code, error):
    monkeypatch.setattr(ci, "DOCKER", "true")
    monkeypatch.setattr(ci, "inspect", lambda name: {"State": {"Running": False, "ExitCode": exit_code}})
    server = sse_server([token(i) for i in range(1, 6)] + [token(6, final="length")])
    try:
        if error:
            with pytest.raises(ci.CheckFailed, match=error):
                ci.drain(f"http://127.0.0.1:{server.server_port}", "c", new_tokens=6, stop_timeout=5)
        else:
            assert "final event finish_reason=length" in ci.drain(
                f"http://127.0.0.1:{server.server_port}", "c", new_tokens=6, stop_timeout=5)
    finally:
        server.shutdown()
