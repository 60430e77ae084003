"""A decode step's greedy tokens for the rows a grammar constrains, under its token bitmask.

``grammar_argmax`` writes, for each listed row r, the first index of the largest ``logits[r, t]``
among the tokens t < ``vocab`` that ``bitmask[r]`` allows (xgrammar's layout: int32 words, bit
t % 32 of word t / 32 set for an allowed token) into ``ids[r]``, and leaves the other rows' ids
alone. NaN logits are never drawn; a row whose allowed logits are all -inf gets its first allowed
token, and one that allows no token gets 0. On CUDA it is one launch (``csrc/grammar_argmax.cu``)
in place of masking the logits and searching those rows again; on the CPU the same in PyTorch.
"""

import torch


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None, ids: torch.Tensor,
           vocab: int) -> None:
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"logits must be float32 [batch, vocab] with contiguous rows, got {logits.dtype} "
                         f"{list(logits.shape)} strides {logits.stride()}")
    if not 1 <= vocab <= logits.shape[1]:
        raise ValueError(f"vocab {vocab} must be in 1..{logits.shape[1]} (the logits' width)")
    words = (vocab + 31) // 32
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[0] < logits.shape[0] \
            or bitmask.shape[1] < words or bitmask.stride(1) != 1:
        raise ValueError(f"bitmask must be int32 [>= {logits.shape[0]}, >= {words}] for {logits.shape[0]} rows "
                         f"of {vocab} tokens, got {bitmask.dtype} {list(bitmask.shape)}")
    if ids.dtype != torch.int32 or ids.dim() != 1 or ids.shape[0] < logits.shape[0] or not ids.is_contiguous():
        raise ValueError(f"ids must be int32 [>= {logits.shape[0]}], got {ids.dtype} {list(ids.shape)}")
    if rows is not None and (rows.dtype != torch.int32 or rows.dim() != 1 or not rows.is_contiguous()):
        raise ValueError(f"rows must be int32 [n], got {rows.dtype} {list(rows.shape)}")
    devices = {t.device for t in (logits, bitmask, ids) + ((rows,) if rows is not None else ())}
    if len(devices) != 1:
        raise ValueError(f"logits, bitmask, rows and ids must share a device, got {sorted(map(str, devices))}")


def allowed_tokens(bitmask_rows: torch.Tensor, vocab: int) -> torch.Tensor:
    """Booleans [n, vocab] of the tokens that int32 bitmask rows [n, words] allow."""
    shifts = torch.arange(32, dtype=torch.int64, device=bitmask_rows.device)
    words = bitmask_rows.to(torch.int64) & 0xFFFFFFFF
    return ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]


def reference_grammar_argmax(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None,
                             ids: torch.Tensor, vocab: int) -> None:
    chosen = torch.arange(logits.shape[0], device=logits.device) if rows is None else rows.long()
    if chosen.numel() == 0:
        return
    allowed = allowed_tokens(bitmask[chosen], vocab)
    values = logits[chosen, :vocab]
    allowed &= ~values.isnan()
    masked = torch.where(allowed, values, torch.full_like(values, float("-inf")))
    best = masked.argmax(dim=-1)
    first_allowed = allowed.int().argmax(dim=-1)          # 0 where none is allowed
    all_minus_inf = masked.isneginf().all(dim=-1)
    ids[chosen] = torch.where(all_minus_inf, first_allowed, best).to(torch.int32)


def grammar_argmax(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None, ids: torch.Tensor,
                   vocab: int) -> None:
    """See the module's docstring. ``rows``: int32 indices of the constrained rows (None: every
    row of ``logits``). Reads nothing back to the host, so it may be captured or queued freely."""
    _check(logits, bitmask, rows, ids, vocab)
    if logits.is_cuda:
        from . import ops
        ops.load(logits.device)
        torch.ops.flashdecode.grammar_argmax(logits, bitmask, rows, ids, vocab)
    else:
        reference_grammar_argmax(logits, bitmask, rows, ids, vocab)
