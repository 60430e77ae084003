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
    max_logprobs: int = 20                   # top log-probabilities per position a request may ask for
    max_n: int = 16                          # choices per prompt a request may ask for
    log_prompts: bool = False                # debug: put prompt and generated text into the logs
    log_level: str = "info"
    shutdown_timeout: float = 30.0           # on SIGTERM: seconds running requests may still take

    def __post_init__(self):
        if not 0 <= self.max_logprobs <= 20:
            raise ValueError(f"max_logprobs {self.max_logprobs} is outside 0..20")
        if not 1 <= self.max_n <= 16:
            raise ValueError(f"max_n {self.max_n} is outside 1..16")
