"""Token selection on the device the logits live on.

Rows that ask for log-probabilities get them from the model's own distribution: the
log-softmax of the raw logits, before any bias, penalty or temperature (vLLM V1's default,
``raw_logprobs``), computed only for those rows. Then, in vLLM's order, the logit bias, the
repetition penalty, the presence and frequency penalties change the logits of the rows that
have them (a step whose rows have none skips each). Greedy rows take the argmax. Sampled rows
apply temperature, top-k and top-p, then draw by the exponential race (argmax of p / E with
E ~ Exp(1)). The uniforms behind E come from a counter-based hash of (request seed, output
position, token id), so a request with a seed yields the same text whatever else shares its
batch.
"""

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .penalties import PenaltyState, to_device

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
    logprobs: list[int] | None = None    # per row: -1 none, else the sampled token's and this many top ones
    penalty_rows: list[int] | None = None  # per row: its PenaltyState row, -1 none; None: no row has one

    @property
    def want_logprobs(self) -> bool:
        return self.logprobs is not None and any(k >= 0 for k in self.logprobs)

    @property
    def greedy_only(self) -> bool:
        """Whether every row takes the argmax of its unchanged logits, without log-probabilities."""
        return (not self.want_logprobs and self.penalty_rows is None and all(t <= 0 for t in self.temperature)
                and all(p == 1.0 for p in self.repetition_penalty))


class StepLogprobs(NamedTuple):
    """Log-probabilities of the rows ``rows`` (host list) of a step, on the device."""
    rows: list[int]
    sampled: torch.Tensor                # [r] float32: of the token drawn
    top_ids: torch.Tensor | None         # [r, k] int32, the likeliest first; None when no row asks for any
    top_logprobs: torch.Tensor | None    # [r, k] float32


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


def _penalty_index(rows: SamplingRows, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch rows that hold a PenaltyState row, and those state rows, on the device."""
    pairs = [(i, r) for i, r in enumerate(rows.penalty_rows) if r >= 0]
    return (to_device([i for i, _ in pairs], torch.int64, device),
            to_device([r for _, r in pairs], torch.int64, device))


def apply_logit_bias(logits: torch.Tensor, batch_rows: torch.Tensor, state_rows: torch.Tensor,
                     state: PenaltyState) -> None:
    """logits[i] += bias[i] (OpenAI's logit_bias), in place."""
    logits.index_add_(0, batch_rows, state.bias[state_rows])


def apply_presence_frequency(logits: torch.Tensor, batch_rows: torch.Tensor, state_rows: torch.Tensor,
                             state: PenaltyState) -> None:
    """OpenAI's definition, over the tokens generated so far (count c[j] of token j):
    logits[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty, in place."""
    counts = state.counts[state_rows]
    penalty = (counts * state.frequency[state_rows].unsqueeze(1)
               + (counts > 0).to(counts.dtype) * state.presence[state_rows].unsqueeze(1))
    logits.index_add_(0, batch_rows, penalty, alpha=-1.0)


def count_generated(ids: torch.Tensor, batch_rows: torch.Tensor, state_rows: torch.Tensor,
                    state: PenaltyState) -> None:
    """Adds the drawn tokens to their requests' counts, on the device."""
    flat = state_rows * state.vocab + ids[batch_rows]
    one = torch.ones(1, dtype=state.counts.dtype, device=ids.device).expand(batch_rows.shape[0])
    state.counts.view(-1).index_add_(0, flat, one)


def top_logprobs(raw: torch.Tensor, ids: torch.Tensor, asked: list[int], rows: list[int]) -> StepLogprobs:
    """From ``raw`` = log-softmax of the asking rows' logits: the drawn token's value and the
    ``max(asked)`` likeliest tokens of each row (a row that asked for fewer reads only its first)."""
    sampled = raw.gather(1, ids.unsqueeze(1)).squeeze(1)
    k = max(asked)
    if k <= 0:
        return StepLogprobs(rows, sampled, None, None)
    values, indices = raw.topk(min(k, raw.shape[-1]), dim=-1)
    return StepLogprobs(rows, sampled, indices.to(torch.int32), values)


def prompt_logprobs(logits: torch.Tensor, prompt_ids: list[int], first: int,
                    k: int) -> list[tuple[float, int, list[tuple[int, float]]]]:
    """Per prompt position after ``first`` that ``logits`` (of the prompt's tokens from position
    ``first`` on, row j predicting position first + j + 1) predict: the raw log-probability of the
    prompt's token there, its rank (1: the likeliest) and the ``k`` likeliest tokens. Read back at
    once (a prefill step)."""
    targets = prompt_ids[first + 1:first + 1 + logits.shape[0]]
    if not targets:
        return []
    raw = clean_logits(logits[:len(targets)]).log_softmax(dim=-1)
    index = torch.tensor(targets, dtype=torch.int64, device=raw.device)
    chosen = raw.gather(1, index.unsqueeze(1))
    ranks = ((raw > chosen).sum(dim=-1) + 1).tolist()
    values = chosen.squeeze(1).tolist()
    if k <= 0:
        return [(v, r, []) for v, r in zip(values, ranks)]
    best, best_ids = raw.topk(min(k, raw.shape[-1]), dim=-1)
    return [(v, r, list(zip(i, b))) for v, r, i, b in zip(values, ranks, best_ids.tolist(), best.tolist())]


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


def sample(logits: torch.Tensor, rows: SamplingRows,
           penalties: PenaltyState | None = None) -> tuple[torch.Tensor, StepLogprobs | None]:
    """Returns token ids [n] (int64) and, for the rows that ask, their log-probabilities."""
    return sample_clean(clean_logits(logits), rows, penalties=penalties)


def sample_clean(logits: torch.Tensor, rows: SamplingRows, greedy_ids: torch.Tensor | None = None,
                 penalties: PenaltyState | None = None) -> tuple[torch.Tensor, StepLogprobs | None]:
    """``sample`` of logits that went through ``clean_logits`` (biases and penalties change them in
    place); ``greedy_ids``: their ``argmax_rows`` where already known."""
    raw = asking = asking_index = None
    if rows.want_logprobs:
        asking = [i for i, k in enumerate(rows.logprobs) if k >= 0]
        if len(asking) < len(rows.logprobs):
            asking_index = to_device(asking, torch.int64, logits.device)
        raw = (logits if asking_index is None else logits.index_select(0, asking_index)).log_softmax(dim=-1)
    penalty_index = None
    if rows.penalty_rows is not None:
        penalty_index = _penalty_index(rows, logits.device)
        apply_logit_bias(logits, *penalty_index, penalties)
        greedy_ids = None
    if any(p != 1.0 for p in rows.repetition_penalty):
        _apply_repetition_penalty(logits, rows.repetition_penalty, rows.history)
        greedy_ids = None
    if penalty_index is not None:
        apply_presence_frequency(logits, *penalty_index, penalties)
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
    if penalty_index is not None:
        count_generated(ids, *penalty_index, penalties)
    logprobs = None
    if raw is not None:
        drawn = ids if asking_index is None else ids[asking_index]
        logprobs = top_logprobs(raw, drawn, [rows.logprobs[i] for i in asking], asking)
    return ids, logprobs
