"""Token selection on the device the logits live on.

Greedy rows take the argmax. Sampled rows apply repetition penalty, temperature, top-k and
top-p, then draw by the exponential race (argmax of p / E with E ~ Exp(1)). The uniforms behind
E come from a counter-based hash of (request seed, output position, token id), so a request
with a seed yields the same text whatever else shares its batch.
"""

import math
from dataclasses import dataclass

import torch

MASK32 = 0xFFFFFFFF
LARGEST_BELOW_ONE = 1.0 - 2.0 ** -24     # the float32 just below 1


@dataclass
class SamplingRows:
    """Per-row parameters of one step, built on the host from the batch's sequences."""
    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    repetition_penalty: list[float]
    seeds: list[int]
    positions: list[int]                 # output index of the token being drawn
    history: list[list[int]] | None      # token ids seen, for rows with a repetition penalty
    want_logprobs: bool

    @property
    def greedy_only(self) -> bool:
        """Whether every row takes the argmax of its unchanged logits, without log-probabilities."""
        return (not self.want_logprobs and all(t <= 0 for t in self.temperature)
                and all(p == 1.0 for p in self.repetition_penalty))


def clean_logits(logits: torch.Tensor) -> torch.Tensor:
    """float32 logits with NaN read as -inf (a NaN is never drawn)."""
    return logits.to(torch.float32, copy=True).nan_to_num_(nan=float("-inf"))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-D tensor (the first index of each row's maximum), in two passes:
    the maxima of up to 256 equal slices of each row, then the best slice. One pass over a
    vocabulary-wide row runs one row per thread block (28 us over 128,256 logits on an H200)."""
    n, width = x.shape
    slices = math.gcd(width, 256)
    if slices < 16:
        return x.argmax(dim=-1)
    step = width // slices
    best, at = x.view(n, slices, step).max(dim=-1)
    which = best.argmax(dim=-1, keepdim=True)
    return (which * step + at.gather(1, which)).squeeze(1)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & MASK32
    return x ^ (x >> 16)


def hashed_uniforms(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[n, vocab] uniforms in (0, 1), a pure function of (seed, position, column)."""
    key = _mix32((seeds & MASK32) ^ _mix32((seeds >> 32) & MASK32) ^ _mix32(positions * 0x9E3779B1 & MASK32))
    cols = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    bits = _mix32((key.unsqueeze(1) + cols * 0x27D4EB2F) & MASK32)
    bits = _mix32(bits ^ key.unsqueeze(1))
    # the top 128 of the 2**32 values round to 1.0 in float32, whose -log is 0: a token of probability
    # 0 (masked by a grammar, or underflowed) would then race 0/0 = NaN, and argmax takes a NaN
    return (bits.to(torch.float64) + 0.5).div_(2.0 ** 32).to(torch.float32).clamp_(max=LARGEST_BELOW_ONE)


def _apply_repetition_penalty(logits, penalty, history):
    rows = [i for i, p in enumerate(penalty) if p != 1.0]
    width = max(len(history[i]) for i in rows)
    ids = torch.zeros(len(rows), max(width, 1), dtype=torch.int64)
    valid = torch.zeros_like(ids, dtype=torch.bool)
    for r, i in enumerate(rows):
        ids[r, :len(history[i])] = torch.tensor(history[i], dtype=torch.int64)
        valid[r, :len(history[i])] = True
    ids, valid = ids.to(logits.device), valid.to(logits.device)
    row_index = torch.tensor(rows, device=logits.device)
    p = torch.tensor([penalty[i] for i in rows], device=logits.device).unsqueeze(1)
    picked = logits[row_index].gather(1, ids)
    penalised = torch.where(picked > 0, picked / p, picked * p)
    sub = logits[row_index]
    sub.scatter_(1, ids, torch.where(valid, penalised, picked))
    logits[row_index] = sub


def _filter_top_k_top_p(scaled, top_k, top_p):
    device = scaled.device
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    vocab = scaled.shape[-1]
    k = torch.tensor([min(t, vocab) if t > 0 else vocab for t in top_k], device=device).unsqueeze(1)
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs             # mass strictly above each token
    p = torch.tensor(top_p, device=device).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill((before >= p) & (ranks > 0), float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter_(1, order, sorted_logits)


def sample(logits: torch.Tensor, rows: SamplingRows) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns token ids [n] (int64) and, if asked, their log-probabilities [n]."""
    return sample_clean(clean_logits(logits), rows)


def sample_clean(logits: torch.Tensor, rows: SamplingRows,
                 greedy_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``sample`` of logits that went through ``clean_logits`` (a repetition penalty changes them in
    place); ``greedy_ids``: their ``argmax_rows`` where already known."""
    if any(p != 1.0 for p in rows.repetition_penalty):
        _apply_repetition_penalty(logits, rows.repetition_penalty, rows.history)
        greedy_ids = None
    if greedy_ids is None:
        greedy_ids = argmax_rows(logits)
    ids, scaled = greedy_ids, logits
    if not all(t <= 0 for t in rows.temperature):
        device = logits.device
        temperature = torch.tensor([t if t > 0 else 1.0 for t in rows.temperature], device=device)
        scaled = logits / temperature.unsqueeze(1)
        if any(k > 0 for k in rows.top_k) or any(p < 1.0 for p in rows.top_p):
            scaled = _filter_top_k_top_p(scaled, rows.top_k, rows.top_p)
        uniforms = hashed_uniforms(torch.tensor(rows.seeds, dtype=torch.int64, device=device),
                                   torch.tensor(rows.positions, dtype=torch.int64, device=device),
                                   logits.shape[-1])
        race = scaled.softmax(dim=-1) / -torch.log(uniforms)
        drawn = argmax_rows(race)
        greedy_rows = torch.tensor([t <= 0 for t in rows.temperature], device=device)
        ids = torch.where(greedy_rows, greedy_ids, drawn)
    logprobs = None
    if rows.want_logprobs:
        logprobs = scaled.log_softmax(dim=-1).gather(1, ids.unsqueeze(1)).squeeze(1)
    return ids, logprobs
