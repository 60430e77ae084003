"""Structured logs: one JSON object per line on stderr.

Structured fields travel in ``extra={"fields": {...}}``; they are merged into the top level of the
record, so a log line reads ``{"ts": ..., "level": ..., "logger": ..., "msg": ..., "request_id": ...}``.
"""

import json
import logging
import logging.config
import time


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                  + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def log_config(level: str = "info") -> dict:
    """A ``logging.config.dictConfig`` dict; also given to uvicorn so its own lines are JSON too."""
    level = level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "json",
                                "stream": "ext://sys.stderr"}},
        "root": {"handlers": ["stderr"], "level": level},
        "loggers": {
            # uvicorn installs its own handlers unless told otherwise; route everything to ours.
            "uvicorn": {"handlers": [], "level": level, "propagate": True},
            "uvicorn.error": {"handlers": [], "level": level, "propagate": True},
            "uvicorn.access": {"handlers": [], "level": "WARNING", "propagate": True},
        },
    }


def configure_logging(level: str = "info") -> None:
    logging.config.dictConfig(log_config(level))
    logging.captureWarnings(True)
    _quiet_transformers()


def _quiet_transformers() -> None:
    """transformers writes through its own handler and draws progress bars on stderr; route
    its records to ours and drop the bars, so that every line stays JSON."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    hf_logging.disable_progress_bar()
