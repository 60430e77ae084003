"""``python -m server``: serve a model over HTTP (the command line; ``__main__.py`` runs it).

Every option also reads an environment variable (HOST, PORT, MODEL, API_KEY, ...: the option's
name in upper case with '-' as '_'); a command-line flag wins over the environment.
"""

import argparse
import dataclasses
import logging
import os
import sys

from .logging_config import configure_logging, log_config
from .settings import Settings

log = logging.getLogger("server")

# Engine sizing flags, passed to EngineConfig only when given (else the engine's defaults hold).
ENGINE_FLAGS = {
    "block_size": (int, "KV cache block size in tokens"),
    "num_blocks": (int, "KV cache blocks (default: sized from memory)"),
    "cpu_kv_cache_tokens": (int, "KV cache tokens on the CPU when --num-blocks is not given"),
    "gpu_memory_fraction": (float, "share of GPU memory for weights, KV cache and graphs"),
    "max_batch": (int, "sequences decoded in one step"),
    "max_model_len": (int, "context length cap (default: the model's)"),
    "max_prefill_tokens": (int, "prompt tokens admitted per step"),
    "prefill_delay_steps": (int, "decode steps an arriving prompt may wait, while others decode, to be "
                                 "prefilled together with later arrivals (0: at once)"),
    "chained_prefill_tokens": (int, "while others decode, a prefill may follow a prefill at once if the "
                                    "prompts waiting have at most this many tokens to compute (0: never)"),
    "max_waiting_requests": (int, "queue bound in requests; past it requests get 429"),
    "max_waiting_tokens": (int, "queue bound in prompt + max_new tokens; past it requests get 429"),
}


DTYPES = ("float32", "bfloat16", "float16")
CPU_WEIGHTS = ("auto", "quantized", "float")    # models.CPU_WEIGHTS, without importing torch here
KV_CACHE_DTYPES = ("auto", "int8")              # server.engine.config.KV_CACHE_DTYPES
REMOVED_KV_CACHE_DTYPES = ("fp8",)              # server.engine.config.REMOVED_KV_CACHE_DTYPES says why
LOG_LEVELS = ("debug", "info", "warning", "error")


def _env(name: str, default=None):
    """The environment's value for an option (an empty one counts as unset)."""
    return os.environ.get(name.upper().replace("-", "_")) or default


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = Settings()
    p = argparse.ArgumentParser(prog="python -m server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default=_env("host", d.host), help="bind address (default %(default)s)")
    p.add_argument("--port", type=int, default=_env("port", str(d.port)), help="(default %(default)s)")
    p.add_argument("--model", default=_env("model", d.model),
                   help="'default' (embedded SmolLM2-135M-Instruct), a Hugging Face folder, a .gguf "
                        "file or random:<preset>")
    p.add_argument("--dtype", default=_env("dtype"), choices=DTYPES,
                   help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--device", default=_env("device", "auto"), help="auto, cpu, cuda or cuda:N")
    p.add_argument("--api-key", default=_env("api_key"),
                   help="require 'Authorization: Bearer <key>' on everything but /health")
    p.add_argument("--max-body-bytes", type=int, default=_env("max_body_bytes", str(d.max_body_bytes)),
                   help="larger request bodies answer 413 (default %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=_env("max_prompt_tokens"),
                   help="longest prompt accepted (default: the context length less one)")
    p.add_argument("--default-max-new-tokens", type=int,
                   default=_env("default_max_new_tokens", str(d.default_max_new_tokens)),
                   help="tokens generated when a TGI or chat request names no limit "
                        "(/v1/completions: OpenAI's 16, or this if lower)")
    p.add_argument("--log-prompts", action="store_true", default=_env("log_prompts") == "1",
                   help="debug: write prompts and generated text into the logs")
    p.add_argument("--log-level", default=_env("log_level", d.log_level),
                   choices=LOG_LEVELS)
    p.add_argument("--shutdown-timeout", type=float,
                   default=_env("shutdown_timeout", str(d.shutdown_timeout)),
                   help="on SIGTERM or SIGINT, seconds running requests may take to finish before the "
                        "server ends them; new requests get 503 meanwhile (default %(default)s)")
    engine = p.add_argument_group("engine sizing")
    for name, (kind, help_text) in ENGINE_FLAGS.items():
        flag = "--" + name.replace("_", "-")
        engine.add_argument(flag, type=kind, default=_env(name) or None, help=help_text)
    engine.add_argument("--no-cuda-graphs", action="store_true", help="decode without CUDA graphs")
    engine.add_argument("--no-prefix-caching", action="store_true", default=_env("no_prefix_caching") == "1",
                        help="prefill every prompt whole instead of reusing cached KV blocks of earlier requests")
    engine.add_argument("--prefill-graph-buckets", default=_env("prefill_graph_buckets"),
                        type=lambda v: () if v in ("", "off") else tuple(int(x) for x in v.split(",") if x),
                        help="comma-separated token counts: whole prompts packed up to one of these replay "
                             "a CUDA graph ('off': always eager; default 128,256,...,4096 on a GPU)")
    engine.add_argument("--cpu-weights", default=_env("cpu_weights"), choices=CPU_WEIGHTS,
                        help="CPU: run a GGUF's own quantised weights (auto: when the model has them) or float ones")
    engine.add_argument("--kv-cache-dtype", default=_env("kv_cache_dtype"),
                        help="KV cache element type: auto (the model's dtype) or int8 (codes with a scale per "
                             "token and KV head: about half the bytes, 1.9x the tokens or more)")
    engine.add_argument("--api-workers", type=api_workers_arg, default=_env("api_workers", "auto"),
                        help="HTTP worker processes in front of the one engine process; queue limits apply "
                             "per worker (default auto: on a GPU one per 4 CPU cores, at most 4; on the CPU 1)")
    engine.add_argument("--engine-thread", action="store_true", default=_env("engine_thread") == "1",
                        help="run the engine in a thread of the server process instead of a process of its own")
    args = p.parse_args(argv)
    if args.kv_cache_dtype in REMOVED_KV_CACHE_DTYPES:
        p.error(f"argument --kv-cache-dtype: {args.kv_cache_dtype!r} was removed (the e4m3 cache moved SmolLM2's "
                f"predictions 15x as far as the bf16 cache's own rounding); use --kv-cache-dtype int8")
    if args.kv_cache_dtype is not None and args.kv_cache_dtype not in KV_CACHE_DTYPES:
        p.error(f"argument --kv-cache-dtype: invalid choice {args.kv_cache_dtype!r} "
                f"(choose from {', '.join(KV_CACHE_DTYPES)})")
    for flag, value, choices in (("--dtype", args.dtype, DTYPES), ("--log-level", args.log_level, LOG_LEVELS),
                                 ("--cpu-weights", args.cpu_weights, CPU_WEIGHTS)):
        if value is not None and value not in choices:     # argparse checks flags, not defaults
            p.error(f"argument {flag}: invalid choice {value!r} from the environment "
                    f"(choose from {', '.join(choices)})")
    return args


def api_workers_arg(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        workers = int(value)
    except ValueError:
        workers = 0
    if workers < 1:
        raise argparse.ArgumentTypeError(f"'auto' or a whole number of at least 1, not {value!r}")
    return workers


def resolve_api_workers(workers: int | str, device: str, engine_thread: bool) -> int:
    """'auto': several HTTP workers where one engine on a GPU makes tokens faster than one event
    loop can stream them (see the README's HTTP table), one on the CPU or with the engine in a thread."""
    if workers != "auto":
        return workers
    if engine_thread or not device.startswith("cuda"):
        return 1
    return max(1, min(4, usable_cpus() // 4))


def usable_cpus() -> int:
    """CPUs this process may run on: a container's cpuset and CPU quota, not the host's count."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:                         # not Linux
        return os.cpu_count() or 1
    from .engine.threads import cgroup_cpu_limit
    return min(cpus, cgroup_cpu_limit() or cpus)


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def settings_from(args: argparse.Namespace) -> Settings:
    return Settings(host=args.host, port=args.port, model=args.model, dtype=args.dtype,
                    device=resolve_device(args.device), api_key=args.api_key or None,
                    max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
                    default_max_new_tokens=args.default_max_new_tokens,
                    log_prompts=args.log_prompts, log_level=args.log_level,
                    shutdown_timeout=args.shutdown_timeout)


def engine_options(args: argparse.Namespace) -> dict:
    options = {name: getattr(args, name) for name in ENGINE_FLAGS if getattr(args, name) is not None}
    if args.no_cuda_graphs:
        options["cuda_graphs"] = False
    if args.no_prefix_caching:
        options["prefix_caching"] = False
    if args.cpu_weights is not None:
        options["cpu_weights"] = args.cpu_weights
    if args.kv_cache_dtype is not None:
        options["kv_cache_dtype"] = args.kv_cache_dtype
    if args.prefill_graph_buckets is not None:
        options["prefill_graph_buckets"] = args.prefill_graph_buckets   # argparse parses a string default too
    return options


def make_loader(args, settings: Settings, channel=None):
    from models import load_model
    from server.engine import Engine, EngineConfig, ProcessEngine, freeze_startup_heap

    config = EngineConfig(**engine_options(args))

    def load():
        if args.engine_thread:
            engine = Engine(load_model(settings.model, dtype=settings.dtype, device=settings.device), config)
        else:
            engine = ProcessEngine(settings.model, dtype=settings.dtype, device=settings.device, config=config,
                                   log_config=log_config(args.log_level), channel=channel)
        freeze_startup_heap()
        return engine
    return load


def http_stack() -> tuple[int, str]:
    """The log level and line saying what uvicorn's "auto" runs on: httptools and uvloop (this
    package's dependencies) where importable, else h11 and asyncio's own loop, which cost more per
    request and per streamed event."""
    import importlib
    missing = []
    for name in ("httptools", "uvloop"):
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        fallbacks = {"httptools": "h11's parser", "uvloop": "asyncio's own event loop"}
        return logging.WARNING, (f"{' and '.join(missing)} not installed: HTTP runs on "
                                 f"{' and '.join(fallbacks[m] for m in missing)}, slower per request and "
                                 "per streamed token")
    return logging.INFO, "HTTP on httptools and uvloop"


def serve(args, settings: Settings, channel=None, sockets=None) -> int:
    """Runs uvicorn with the app until it is told to stop; 1 if the model could not be loaded."""
    import uvicorn

    if channel is None or channel.worker == 0:
        log.log(*http_stack())

    from .app import create_app
    from .shutdown import DrainingServer, drain

    failed: list[str] = []

    def stop_on_load_error(message: str) -> None:
        failed.append(message)
        server.should_exit = True

    app = create_app(settings=settings, loader=make_loader(args, settings, channel), on_load_error=stop_on_load_error)
    # uvicorn's own grace period only covers what the drain left: connections still open after it
    server = DrainingServer(uvicorn.Config(
        app, host=settings.host, port=settings.port, log_config=log_config(settings.log_level),
        access_log=False, timeout_graceful_shutdown=5),
        drain=lambda: drain(app.state.services, settings.shutdown_timeout))
    server.run(sockets=sockets)
    if failed:
        log.error("exiting: the model could not be loaded", extra={"fields": {"error": failed[0]}})
        return 1
    return 0


def _api_worker(argv: list[str], channel, sock) -> None:
    args = parse_args(argv)
    configure_logging(args.log_level)
    sys.exit(serve(args, settings_from(args), channel=channel, sockets=[sock]))


def serve_workers(args, argv: list[str], settings: Settings) -> int:
    """One engine process, ``args.api_workers`` HTTP processes sharing the listening socket."""
    import glob
    import multiprocessing as mp
    import shutil
    import signal
    import tempfile
    import time

    import uvicorn

    from server.engine import EngineConfig
    from server.engine.process import start_shared_core, stop_core

    # counters and histograms summed over the workers (server/metrics.py)
    metrics_dir = None
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        for old in glob.glob(os.path.join(os.environ["PROMETHEUS_MULTIPROC_DIR"], "*.db")):
            os.remove(old)                         # an earlier run's counts (prometheus_client asks for this)
    else:
        metrics_dir = os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="flashdecode-metrics-")
    signals: list[int] = []

    def on_signal(signum, frame):
        signals.append(signum)

    # before any child starts: a signal while they start must still stop them all
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    sock = uvicorn.Config(app=None, host=settings.host, port=settings.port).bind_socket()
    core, channels, core_requests = start_shared_core(settings.model, settings.dtype, settings.device,
                                                      EngineConfig(**engine_options(args)), args.api_workers,
                                                      log_config(args.log_level))
    ctx = mp.get_context("spawn")
    workers = [ctx.Process(target=_api_worker, args=(argv, channel, sock), name=f"api-worker-{channel.worker}")
               for channel in channels]
    for worker in workers:
        worker.start()
    for channel in channels:
        channel.close()                            # each worker holds its pipes' only ends on this side now
    log.info("engine process %d, API worker processes %s", core.pid, [w.pid for w in workers])
    try:
        while core.is_alive() and all(w.is_alive() for w in workers) and not signals:
            time.sleep(0.2)
    finally:
        if signals:
            log.info("received %s: the API workers drain", signal.Signals(signals[0]).name)
        else:
            for worker in workers:
                if not worker.is_alive():
                    log.error("an API worker exited; the others drain", extra={"fields": {
                        "pid": worker.pid, "exitcode": worker.exitcode}})
        for worker in workers:
            if worker.is_alive():
                worker.terminate()                 # SIGTERM: each drains (server/shutdown.py)
        for worker in workers:
            worker.join(timeout=settings.shutdown_timeout + 20)
            if worker.is_alive():
                worker.kill()
                worker.join(timeout=5)
        core_died = not core.is_alive()            # before the drain or during it: the workers failed its streams
        if core_died:
            log.error("the engine process exited", extra={"fields": {"exitcode": core.exitcode}})
        stop_core(core, core_requests)
        sock.close()
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    codes = [w.exitcode for w in workers]
    return 0 if not core_died and all(code in (0, -signal.SIGTERM) for code in codes) else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    configure_logging(args.log_level)
    settings = settings_from(args)
    args.api_workers = resolve_api_workers(args.api_workers, settings.device, args.engine_thread)
    if args.api_workers > 1 and args.engine_thread:
        log.error("--api-workers > 1 needs the engine in a process of its own (drop --engine-thread)")
        return 2
    shown = {k: v for k, v in dataclasses.asdict(settings).items() if k != "api_key"}
    log.info("starting", extra={"fields": {"settings": shown, "api_key": bool(settings.api_key),
                                           "engine": engine_options(args), "api_workers": args.api_workers}})
    if args.api_workers > 1:
        return serve_workers(args, argv, settings)
    return serve(args, settings)

