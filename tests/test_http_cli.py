"""``python -m server`` options and their environment variables."""

import os

import pytest

from server.cli import engine_options, parse_args, resolve_api_workers, settings_from


@pytest.fixture
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("FLASHDECODE_") and name != "FLASHDECODE_CACHE":
            monkeypatch.delenv(name)
    return monkeypatch


def test_defaults_bind_to_localhost(clean_env):
    settings = settings_from(parse_args([]))
    assert (settings.host, settings.port, settings.model) == ("127.0.0.1", 8000, "default")
    assert settings.api_key is None and settings.log_prompts is False
    assert settings.device in ("cpu", "cuda")
    assert engine_options(parse_args([])) == {}


def test_environment_is_read_and_flags_win(clean_env):
    clean_env.setenv("FLASHDECODE_HOST", "0.0.0.0")
    clean_env.setenv("FLASHDECODE_PORT", "9001")
    clean_env.setenv("FLASHDECODE_MODEL", "random:tiny")
    clean_env.setenv("FLASHDECODE_API_KEY", "from-env")
    clean_env.setenv("FLASHDECODE_MAX_BATCH", "8")
    settings = settings_from(parse_args([]))
    assert (settings.host, settings.port, settings.model, settings.api_key) == \
        ("0.0.0.0", 9001, "random:tiny", "from-env")
    assert engine_options(parse_args([])) == {"max_batch": 8}
    settings = settings_from(parse_args(["--port", "9002", "--api-key", "from-flag", "--device", "cpu"]))
    assert (settings.port, settings.api_key, settings.device) == (9002, "from-flag", "cpu")


def test_engine_sizing_flags_pass_through(clean_env):
    args = parse_args(["--max-waiting-requests", "3", "--max-waiting-tokens", "500", "--block-size", "16",
                       "--no-cuda-graphs", "--log-prompts", "--max-prompt-tokens", "100"])
    assert engine_options(args) == {"max_waiting_requests": 3, "max_waiting_tokens": 500,
                                    "block_size": 16, "cuda_graphs": False}
    settings = settings_from(args)
    assert settings.log_prompts and settings.max_prompt_tokens == 100


def test_bad_values_are_refused(clean_env, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--port", "eighty"])
    assert "--port" in capsys.readouterr().err


@pytest.mark.parametrize("name, value, flag", [("PORT", "eighty", "--port"), ("MAX_BATCH", "many", "--max-batch"),
                                               ("API_WORKERS", "1 4", "--api-workers"),
                                               ("API_WORKERS", "0", "--api-workers"),
                                               ("DTYPE", "fp8", "--dtype"), ("LOG_LEVEL", "verbose", "--log-level"),
                                               ("NO_PREFIX_CACHING", "maybe", "")])
def test_bad_environment_values_are_refused_like_flags(clean_env, capsys, name, value, flag):
    clean_env.setenv("FLASHDECODE_" + name, value)
    with pytest.raises(SystemExit) as exit_info:
        parse_args([])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"FLASHDECODE_{name}={value!r}" in err and flag in err


def test_unknown_and_invalid_variables_are_named_in_one_error(clean_env, capsys):
    clean_env.setenv("FLASHDECODE_MAX_BACH", "8")
    clean_env.setenv("FLASHDECODE_PORT", "eighty")
    clean_env.setenv("FLASHDECODE_LOG_LEVEL", "verbose")
    with pytest.raises(SystemExit) as exit_info:
        parse_args([])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 2
    assert "FLASHDECODE_MAX_BACH is not a setting of this server (did you mean FLASHDECODE_MAX_BATCH?)" in err
    assert "FLASHDECODE_PORT='eighty'" in err and "FLASHDECODE_LOG_LEVEL='verbose'" in err


def test_variables_without_the_prefix_are_not_read(clean_env):
    """A shell's LOG_LEVEL=INFO or an unrelated API_KEY used to stop the server or turn
    authentication on."""
    for name, value in (("LOG_LEVEL", "INFO"), ("API_KEY", "someone-elses"), ("PORT", "eighty"),
                        ("MODEL", "random:tiny"), ("HOST", "0.0.0.0"), ("MAX_BATCH", "many")):
        clean_env.setenv(name, value)
    settings = settings_from(parse_args([]))
    assert (settings.api_key, settings.log_level, settings.port, settings.model, settings.host) == \
        (None, "info", 8000, "default", "127.0.0.1")


def test_switches_and_other_variables_of_the_prefix(clean_env):
    import server.engine.process
    from server.cli import OTHER_VARIABLES
    assert server.engine.process.PROFILE_ENV in OTHER_VARIABLES
    clean_env.setenv("FLASHDECODE_NO_PREFIX_CACHING", "1")
    clean_env.setenv("FLASHDECODE_LOG_PROMPTS", "true")
    clean_env.setenv("FLASHDECODE_ENGINE_THREAD", "0")
    clean_env.setenv("FLASHDECODE_CORE_PROFILE", "/tmp/x")
    args = parse_args([])
    assert args.no_prefix_caching and args.log_prompts and not args.engine_thread
    assert engine_options(args) == {"prefix_caching": False}


def test_api_workers_auto_is_one_on_the_cpu_and_per_four_cores_on_a_gpu(clean_env):
    assert parse_args([]).api_workers == "auto"
    clean_env.setenv("FLASHDECODE_API_WORKERS", "3")
    assert parse_args([]).api_workers == 3
    assert parse_args(["--api-workers", "2"]).api_workers == 2
    assert resolve_api_workers("auto", "cpu", engine_thread=False) == 1
    assert resolve_api_workers(2, "cpu", engine_thread=False) == 2
    clean_env.setattr("server.cli.usable_cpus", lambda: 16)
    assert resolve_api_workers("auto", "cuda", engine_thread=False) == 4
    assert resolve_api_workers("auto", "cuda:1", engine_thread=True) == 1
    clean_env.setattr("server.cli.usable_cpus", lambda: 64)
    assert resolve_api_workers("auto", "cuda", engine_thread=False) == 4
    clean_env.setattr("server.cli.usable_cpus", lambda: 6)
    assert resolve_api_workers("auto", "cuda", engine_thread=False) == 1


def test_empty_environment_values_count_as_unset(clean_env):
    for name in ("PORT", "MAX_BATCH", "API_WORKERS", "DTYPE", "LOG_LEVEL", "MAX_PROMPT_TOKENS"):
        clean_env.setenv("FLASHDECODE_" + name, "")
    args = parse_args([])
    assert (args.port, args.api_workers, args.dtype, args.log_level, args.max_prompt_tokens) == \
        (8000, "auto", None, "info", None)
    assert engine_options(args) == {}


def test_the_http_stack_is_named_and_a_missing_fast_path_is_a_warning(monkeypatch):
    import logging
    import sys

    from server.cli import http_stack
    assert http_stack() == (logging.INFO, "HTTP on httptools and uvloop")
    monkeypatch.setitem(sys.modules, "uvloop", None)          # import uvloop now raises ImportError
    level, line = http_stack()
    assert level == logging.WARNING
    assert line.startswith("uvloop not installed: HTTP runs on asyncio's own event loop")
