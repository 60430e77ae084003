class QueueFullError(RuntimeError):
    """The waiting queue is at its request or token bound; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class EngineDeadError(RuntimeError):
    """The engine loop stopped on a fatal error; the service is unhealthy."""
