"""Sliding-window attention: a layer with window ``W`` lets the query at position ``seq_len - 1``
attend to key positions ``p >= seq_len - W`` only (its own and the ``W - 1`` before it), the
convention of transformers' sliding layers (Gemma 3, Qwen2). ``None`` attends to every position.
"""

import torch


def check_window(window) -> int | None:
    """``window`` as an int, or None; anything else (zero, negative, not an integer) is refused."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    return window


def attended_span(max_seq_len: int, window: int | None) -> int:
    """The most key positions one query attends to in sequences of up to ``max_seq_len`` tokens."""
    return max_seq_len if window is None else min(max_seq_len, window)


def window_starts(seq_lens: torch.Tensor, window: int | None) -> torch.Tensor:
    """The first attended position of each sequence (int64, on ``seq_lens``' device)."""
    seq_lens = seq_lens.long()
    if window is None:
        return torch.zeros_like(seq_lens)
    return (seq_lens - window).clamp_min(0)
