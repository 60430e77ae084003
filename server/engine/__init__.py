from .config import EngineConfig
from .core import EngineCore, EngineStats, freeze_startup_heap
from .engine import Engine, EngineFrontend, RequestStream, queued_tokens
from .errors import EngineDeadError, QueueFullError
from .params import FinishEvent, SamplingParams, TokenEvent
from .process import ProcessEngine

__all__ = ["Engine", "EngineConfig", "EngineCore", "EngineFrontend", "EngineStats", "ProcessEngine",
           "RequestStream", "EngineDeadError", "QueueFullError", "FinishEvent", "SamplingParams", "TokenEvent",
           "freeze_startup_heap", "queued_tokens"]
