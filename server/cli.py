"""``python -m server``: serve a model over HTTP (the command line; ``__main__.py`` runs it).

Every option also reads an environment variable: FLASHDECODE_ and the option's name in upper case
with '-' as '_' (FLASHDECODE_MODEL, FLASHDECODE_API_KEY, FLASHDECODE_MAX_BATCH, ...; switches take
1 or 0); a command-line flag wins over the environment. An unknown FLASHDECODE_ variable or an
invalid value stops the start with one error naming them all.
"""

import argparse
import dataclasses
import difflib
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
    "cpu_prefill_step_s": (float, "CPU: seconds a prefill step may take, by the prefill speed measured at "
                                  "start-up (a long prompt's chunks alternate with decode steps; 0: no limit)"),
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

ENV_PREFIX = "FLASHDECODE_"
# Variables with the prefix read elsewhere, not options: the model and kernel cache folder
# (models/loader.py, kernels/build.py) and the engine core's profile (server/engine/process.py).
OTHER_VARIABLES = frozenset({"FLASHDECODE_CACHE", "FLASHDECODE_CORE_PROFILE"})
SWITCH_ON, SWITCH_OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_args(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> argparse.Namespace:
    """The options from ``argv`` over those from ``FLASHDECODE_*`` variables of ``environ``
    (default ``os.environ``) over the defaults."""
    d = Settings()
    p = argparse.ArgumentParser(prog="python -m server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default=d.host, help="bind address (default %(default)s)")
    p.add_argument("--port", type=int, default=d.port, help="(default %(default)s)")
    p.add_argument("--model", default=d.model,
                   help="'default' (embedded SmolLM2-135M-Instruct), a Hugging Face folder, a .gguf "
                        "file or random:<preset>")
    p.add_argument("--dtype", choices=DTYPES, help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--api-key", help="require 'Authorization: Bearer <key>' on everything but /health")
    p.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help="larger request bodies answer 413 (default %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int,
                   help="longest prompt accepted (default: the context length less one)")
    p.add_argument("--default-max-new-tokens", type=int, default=d.default_max_new_tokens,
                   help="tokens generated when a TGI or chat request names no limit "
                        "(/v1/completions: OpenAI's 16, or this if lower)")
    p.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                   help="most log-probabilities per position a request may ask for (logprobs, top_logprobs, "
                        "prompt_logprobs; at most 20; default %(default)s)")
    p.add_argument("--max-n", type=int, default=d.max_n,
                   help="most choices per prompt a request may ask for (n; at most 16; default %(default)s)")
    p.add_argument("--log-prompts", action="store_true",
                   help="debug: write prompts and generated text into the logs")
    p.add_argument("--log-level", default=d.log_level, choices=LOG_LEVELS)
    p.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                   help="on SIGTERM or SIGINT, seconds running requests may take to finish before the "
                        "server ends them; new requests get 503 meanwhile (default %(default)s)")
    engine = p.add_argument_group("engine sizing")
    for name, (kind, help_text) in ENGINE_FLAGS.items():
        engine.add_argument("--" + name.replace("_", "-"), type=kind, help=help_text)
    engine.add_argument("--no-cuda-graphs", action="store_true", help="decode without CUDA graphs")
    engine.add_argument("--no-prefix-caching", action="store_true",
                        help="prefill every prompt whole instead of reusing cached KV blocks of earlier requests")
    engine.add_argument("--prefill-graph-buckets", type=graph_buckets_arg,
                        help="comma-separated token counts: whole prompts packed up to one of these replay "
                             "a CUDA graph ('off': always eager; default 128,256,...,4096 on a GPU)")
    engine.add_argument("--cpu-weights", choices=CPU_WEIGHTS,
                        help="CPU: run a GGUF's own quantised weights (auto: when the model has them) or float ones")
    engine.add_argument("--kv-cache-dtype", type=kv_cache_dtype_arg,
                        help="KV cache element type: auto (the model's dtype) or int8 (codes with a scale per "
                             "token and KV head: about half the bytes, 1.9x the tokens or more)")
    engine.add_argument("--api-workers", type=api_workers_arg, default="auto",
                        help="HTTP worker processes in front of the one engine process; queue limits apply "
                             "per worker (default auto: on a GPU one per 4 CPU cores, at most 4; on the CPU 1)")
    engine.add_argument("--engine-thread", action="store_true",
                        help="run the engine in a thread of the server process instead of a process of its own")
    env_argv = environment_argv(p, os.environ if environ is None else environ)
    return p.parse_args(env_argv + list(sys.argv[1:] if argv is None else argv))


def env_name(action: argparse.Action) -> str:
    """FLASHDECODE_MAX_BATCH for --max-batch."""
    return ENV_PREFIX + action.option_strings[0].removeprefix("--").replace("-", "_").upper()


def environment_argv(parser: argparse.ArgumentParser, environ) -> list[str]:
    """The ``FLASHDECODE_*`` variables as flags, put before the command line's so that its own
    win. Every unknown name and every invalid value is named in one error (exit status 2); an
    empty value counts as unset. Variables without the prefix are never read."""
    options = {env_name(a): a for a in parser._actions if a.option_strings and a.dest != "help"}
    argv, problems = [], []
    for name, value in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX) or name in OTHER_VARIABLES:
            continue
        action = options.get(name)
        if action is None:
            close = difflib.get_close_matches(name, list(options) + sorted(OTHER_VARIABLES), n=1)
            problems.append(f"{name} is not a setting of this server"
                            + (f" (did you mean {close[0]}?)" if close else ""))
        elif value == "":
            continue
        elif action.nargs == 0:                   # a switch such as --no-prefix-caching
            if value.lower() in SWITCH_ON:
                argv.append(action.option_strings[0])
            elif value.lower() not in SWITCH_OFF:
                problems.append(f"{name}={value!r}: give 1 or 0 (true/false)")
        else:
            problem = _check_value(action, value)
            if problem:
                problems.append(f"{name}={value!r}: {problem}")
            argv += [action.option_strings[0], value]
    if problems:
        parser.error("invalid environment: " + "; ".join(problems))
    return argv


def _check_value(action: argparse.Action, value: str) -> str | None:
    try:
        converted = action.type(value) if action.type is not None else value
    except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
        detail = str(exc) if isinstance(exc, argparse.ArgumentTypeError) else \
            f"not a valid {getattr(action.type, '__name__', 'value')}"
        return f"{detail} (as {action.option_strings[0]})"
    if action.choices is not None and converted not in action.choices:
        return f"choose from {', '.join(action.choices)} (as {action.option_strings[0]})"
    return None


def graph_buckets_arg(value: str) -> tuple[int, ...]:
    if value in ("", "off"):
        return ()
    return tuple(int(x) for x in value.split(",") if x)


def kv_cache_dtype_arg(value: str) -> str:
    if value in REMOVED_KV_CACHE_DTYPES:
        raise argparse.ArgumentTypeError(f"{value!r} was removed (the e4m3 cache moved SmolLM2's predictions 15x "
                                         f"as far as the bf16 cache's own rounding); use int8")
    if value not in KV_CACHE_DTYPES:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(KV_CACHE_DTYPES)}, not {value!r}")
    return value


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
                    max_logprobs=args.max_logprobs, max_n=args.max_n,
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
    import signal

    import uvicorn

    if channel is None or channel.worker == 0:
        log.log(*http_stack())

    from .app import create_app
    from .shutdown import HURRY_SIGNAL, DrainingServer, drain

    failed: list[str] = []

    def stop_on_load_error(message: str) -> None:
        failed.append(message)
        server.should_exit = True

    app = create_app(settings=settings, loader=make_loader(args, settings, channel), on_load_error=stop_on_load_error,
                     core_loaded=channel.core_loaded if channel is not None else None)
    # uvicorn's own grace period only covers what the drain left: connections still open after it
    server = DrainingServer(uvicorn.Config(
        app, host=settings.host, port=settings.port, log_config=log_config(settings.log_level),
        access_log=False, timeout_graceful_shutdown=5),
        drain=lambda hurry: drain(app.state.services, settings.shutdown_timeout, hurry))
    if channel is not None:                        # a worker: its parent's second SIGINT (serve_workers)
        signal.signal(HURRY_SIGNAL, server.handle_hurry)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {HURRY_SIGNAL})
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
    from server.shutdown import HURRY_SIGNAL

    # counters and histograms summed over the workers (server/metrics.py)
    metrics_dir = None
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        for old in glob.glob(os.path.join(os.environ["PROMETHEUS_MULTIPROC_DIR"], "*.db")):
            os.remove(old)                         # an earlier run's counts (prometheus_client asks for this)
    else:
        metrics_dir = os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="flashdecode-metrics-")
    signals: list[int] = []
    workers: list = []

    def on_signal(signum, frame):
        # the first signal is passed on as SIGTERM once the loop below sees it; a SIGINT after it
        # as HURRY_SIGNAL, so that each worker ends its running requests now (server/shutdown.py)
        if signals and signum == signal.SIGINT:
            for worker in workers:
                if worker.is_alive():
                    os.kill(worker.pid, HURRY_SIGNAL)
        signals.append(signum)

    # before any child starts: a signal while they start must still stop them all
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    sock = uvicorn.Config(app=None, host=settings.host, port=settings.port).bind_socket()
    core, channels, core_requests = start_shared_core(settings.model, settings.dtype, settings.device,
                                                      EngineConfig(**engine_options(args)), args.api_workers,
                                                      log_config(args.log_level))
    ctx = mp.get_context("spawn")
    workers += [ctx.Process(target=_api_worker, args=(argv, channel, sock), name=f"api-worker-{channel.worker}")
                for channel in channels]
    # HURRY_SIGNAL would kill a worker that has not yet set its handler: blocked till it has
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {HURRY_SIGNAL})
    try:
        for worker in workers:
            worker.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
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

