"""One GGUF conversion per cache folder, whoever starts it (``models/loader.py``).

Each test converts the embedded GGUF (about 13 s on 2 cores) from a copy at a temporary path into
a fresh cache folder, with servers of two API workers: the engine process and both workers all ask
for the converted folder at once.
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from models.loader import COMPLETE_MARKER
from models.sources import embedded_gguf_path

from .conftest import REPO, free_port

pytestmark = pytest.mark.slow
START_TIMEOUT = 300


@pytest.fixture
def gguf(tmp_path) -> Path:
    copy = tmp_path / "weights" / "smollm2.gguf"
    copy.parent.mkdir()
    shutil.copyfile(embedded_gguf_path(), copy)
    return copy


class Server:
    def __init__(self, gguf: Path, cache: Path, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "server", "--model", str(gguf), "--device", "cpu", "--port",
                 str(self.port), "--api-workers", "2"],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "FLASHDECODE_CACHE": str(cache)})

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, text: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log():
            assert self.process.poll() is None, f"server exited:\n{self.log()[-4000:]}"
            assert time.monotonic() < deadline, f"no {text!r} in the log:\n{self.log()[-4000:]}"
            time.sleep(0.1)

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"server exited:\n{self.log()[-6000:]}"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        pytest.fail(f"not healthy after {START_TIMEOUT} s:\n{self.log()[-6000:]}")

    def generate(self) -> str:
        r = httpx.post(self.url + "/generate", timeout=60,
                       json={"inputs": "The capital of France is", "parameters": {"max_new_tokens": 3}})
        assert r.status_code == 200, r.text
        return r.json()["generated_text"]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def kill(self) -> None:
        """SIGKILL to the server and every process it started (its session)."""
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def converted_folders(cache: Path) -> list[Path]:
    return [p for p in (cache / "models").iterdir() if p.is_dir()]


def test_two_servers_started_together_convert_once_and_both_serve(gguf, tmp_path):
    cache = tmp_path / "cache"
    servers = [Server(gguf, cache, tmp_path / f"server-{i}.log") for i in range(2)]
    try:
        for server in servers:
            server.wait_healthy()
        answers = [server.generate() for server in servers]
        assert answers[0] == answers[1] and answers[0].strip()
        logs = [server.log() for server in servers]
        # six processes asked for the folder; one converted, the others waited and loaded it
        assert sum(log.count("converting smollm2.gguf") for log in logs) == 1, logs
        assert sum(log.count("waiting for another process to convert") for log in logs) >= 1
        assert not any("Errno" in log or "Traceback" in log for log in logs)
        folders = converted_folders(cache)
        assert len(folders) == 1 and (folders[0] / COMPLETE_MARKER).is_file()
    finally:
        for server in servers:
            server.stop()


def test_a_conversion_killed_midway_is_done_again_on_the_next_start(gguf, tmp_path):
    cache = tmp_path / "cache"
    first = Server(gguf, cache, tmp_path / "first.log")
    try:
        first.wait_for_log("converting smollm2.gguf")
        time.sleep(3)                               # into the conversion
    finally:
        first.kill()
    assert not any((folder / COMPLETE_MARKER).is_file() for folder in converted_folders(cache))

    second = Server(gguf, cache, tmp_path / "second.log")
    try:
        second.wait_healthy()
        assert second.log().count("converting smollm2.gguf") == 1
        assert second.generate().strip()
        folders = converted_folders(cache)
        assert len(folders) == 1 and (folders[0] / COMPLETE_MARKER).is_file()
    finally:
        second.stop()


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A cache folder and a stand-in .gguf whose 'conversion' writes a small folder slowly."""
    from models import loader

    monkeypatch.setenv("FLASHDECODE_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "m.gguf"
    source.write_bytes(b"stand-in")
    written = []

    def write_checkpoint(gguf, folder):
        written.append(folder)
        folder.mkdir()
        time.sleep(0.3)
        (folder / "config.json").write_text("{}")

    monkeypatch.setattr(loader, "_write_checkpoint", write_checkpoint)
    return source, written


def test_leftovers_of_an_unfinished_conversion_are_removed_before_converting(fake_gguf):
    from models import loader

    source, written = fake_gguf
    folder = loader.gguf_cache_folder(source)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")      # weights but no marker: never finished
    partial = folder.with_name(folder.name + ".partial-999")
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")
    assert loader.converted_gguf_folder(source) == folder
    assert (folder / COMPLETE_MARKER).is_file() and not partial.exists() and len(written) == 1
    assert loader.converted_gguf_folder(source) == folder and len(written) == 1   # found, not redone


def test_concurrent_callers_convert_once(fake_gguf):
    from concurrent.futures import ThreadPoolExecutor

    from models import loader

    source, written = fake_gguf
    with ThreadPoolExecutor(4) as pool:
        folders = list(pool.map(lambda _: loader.converted_gguf_folder(source), range(4)))
    assert len(set(folders)) == 1 and len(written) == 1
    assert (folders[0] / COMPLETE_MARKER).is_file()
