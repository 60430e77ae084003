"""Device state of the additive logit adjustments: presence and frequency penalties, logit bias.

Each request that asks for one holds a row, from admission to its end: how often it generated
each token so far, its bias over the vocabulary, its two penalties. The rows live on the device
the logits do, and the count of a sampled token is added there right after it is drawn, so a
step never needs the previous step's tokens on the host (they may still be in flight). Requests
without any of these hold no row and a step of them never touches this state.
"""

import torch

FIRST_ROWS = 8


class PenaltyState:
    def __init__(self, vocab: int, device: torch.device):
        self.vocab = vocab
        self.device = device
        self.counts = torch.zeros(0, vocab, dtype=torch.float32, device=device)
        self.bias = torch.zeros(0, vocab, dtype=torch.float32, device=device)
        self.presence = torch.zeros(0, dtype=torch.float32, device=device)
        self.frequency = torch.zeros(0, dtype=torch.float32, device=device)
        self._free: list[int] = []

    @property
    def rows(self) -> int:
        return self.counts.shape[0]

    @property
    def rows_held(self) -> int:
        return self.rows - len(self._free)

    def acquire(self, presence: float, frequency: float, bias: tuple[tuple[int, float], ...]) -> int:
        """A row for a new request, counts zero; raises ValueError for a bias outside the vocabulary."""
        bad = next((i for i, _ in bias if not 0 <= i < self.vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias token id {bad} is outside the vocabulary (0..{self.vocab - 1})")
        if not self._free:
            self._grow()
        row = self._free.pop()
        self.counts[row].zero_()
        self.bias[row].zero_()
        self.presence[row] = presence
        self.frequency[row] = frequency
        if bias:
            ids = to_device([i for i, _ in bias], torch.int64, self.device)
            values = to_device([v for _, v in bias], torch.float32, self.device)
            self.bias[row].index_put_((ids,), values)
        return row

    def release(self, row: int) -> None:
        self._free.append(row)

    def _grow(self) -> None:
        old = self.rows
        new = max(FIRST_ROWS, 2 * old)

        def grown(t: torch.Tensor) -> torch.Tensor:
            out = torch.zeros((new,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
            out[:old].copy_(t)
            return out
        self.counts, self.bias = grown(self.counts), grown(self.bias)
        self.presence, self.frequency = grown(self.presence), grown(self.frequency)
        self._free.extend(range(new - 1, old - 1, -1))


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on ``device`` without waiting for the copy (pinned memory on CUDA)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host
