from .config import EngineConfig
from .engine import Engine, EngineStats, RequestStream
from .errors import EngineDeadError, QueueFullError
from .params import FinishEvent, SamplingParams, TokenEvent

__all__ = ["Engine", "EngineConfig", "EngineStats", "RequestStream", "EngineDeadError", "QueueFullError",
           "FinishEvent", "SamplingParams", "TokenEvent"]
