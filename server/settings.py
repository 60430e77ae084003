"""Options of the HTTP server (the engine's own sizing lives in ``server.engine.EngineConfig``)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "default"
    dtype: str | None = None                 # None: the loader's choice for the device
    device: str = "cpu"
    api_key: str | None = None               # Bearer token required on everything but /health
    max_body_bytes: int = 1 << 20            # larger request bodies answer 413
    max_prompt_tokens: int | None = None     # None: the context length less one generated token
    default_max_new_tokens: int = 256        # when a TGI/chat request names none (capped by context)
    default_completion_tokens: int = 16      # OpenAI's documented default for /v1/completions
    log_prompts: bool = False                # debug: put prompt and generated text into the logs
    log_level: str = "info"
    shutdown_timeout: float = 30.0           # on SIGTERM: seconds running requests may still take
