"""kernels.grammar_argmax on the CPU (the reference the CUDA kernel is checked against, and the CPU
engine's path): against a plain loop over each row's allowed tokens and against xgrammar's own
masking followed by torch.argmax, on fresh random logits and masks; rows not listed keep their
poisoned ids. Mismatched inputs are a ValueError naming what was given."""

import numpy as np
import pytest
import torch
import xgrammar as xgr

from kernels.grammar_argmax import allowed_tokens, grammar_argmax

POISON = -7


def random_case(batch: int, vocab: int, seed: int, density: float):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=gen)
    logits[:, ::7] = logits[:, 3:4]                       # ties: the same value at many indices
    logits[torch.rand(batch, vocab, generator=gen) < 0.05] = float("-inf")
    allowed = torch.rand(batch, vocab, generator=gen) < density
    bitmask = xgr.allocate_token_bitmask(batch, vocab)
    words = np.zeros((batch, bitmask.shape[1] * 32), dtype=np.uint8)
    words[:, :vocab] = allowed.numpy()
    packed = np.packbits(words.reshape(batch, -1, 32)[:, :, ::-1], axis=-1, bitorder="big")
    bitmask.copy_(torch.from_numpy(packed.reshape(batch, -1, 4)[:, :, ::-1].copy().view(np.int32).reshape(batch, -1)))
    return logits, bitmask, allowed


def loop_oracle(logits: torch.Tensor, allowed: torch.Tensor, row: int) -> int:
    best, at = None, None
    for t in torch.nonzero(allowed[row]).flatten().tolist():
        v = logits[row, t].item()
        if v != v:
            continue
        if at is None or v > best:
            best, at = v, t
    return 0 if at is None else at


def test_bitmask_packing_matches_xgrammar_layout():
    logits, bitmask, allowed = random_case(3, 77, 0, 0.5)
    assert torch.equal(allowed_tokens(bitmask, 77), allowed)


@pytest.mark.parametrize("vocab", [33, 1000, 4096])
@pytest.mark.parametrize("density", [0.01, 0.5, 1.0])
@pytest.mark.parametrize("listed", ["all", "some"])
def test_matches_a_loop_over_allowed_tokens(vocab, density, listed):
    batch = 6
    seed = int(torch.randint(0, 2**31, ()).item())
    logits, bitmask, allowed = random_case(batch, vocab, seed, density)
    logits[1, :] = float("-inf")                          # all -inf: the first allowed token
    allowed_row2 = allowed[2].clone()
    logits[2, allowed_row2] = float("nan")                 # every allowed logit NaN: none drawn -> 0
    bitmask[3] = 0                                         # nothing allowed -> 0
    allowed[3] = False
    rows = None if listed == "all" else torch.tensor([4, 1, 2, 3, 0], dtype=torch.int32)
    ids = torch.full((batch + 2,), POISON, dtype=torch.int32)
    grammar_argmax(logits, bitmask, rows, ids, vocab)
    listed_rows = range(batch) if rows is None else rows.tolist()
    for r in range(batch + 2):
        if r not in listed_rows:
            assert ids[r] == POISON, (seed, r)
        elif r == 1:
            first = torch.nonzero(allowed[1]).flatten()
            assert ids[r] == (first[0].item() if len(first) else 0), (seed, r)
        else:
            assert ids[r] == loop_oracle(logits, allowed, r), (seed, r, ids[r])


def test_matches_xgrammar_masking_then_argmax():
    """What the engine did before: xgrammar sets masked logits to -inf, then the argmax."""
    seed = int(torch.randint(0, 2**31, ()).item())
    logits, bitmask, allowed = random_case(8, 49152, seed, 0.3)
    masked = logits.clone()
    xgr.apply_token_bitmask_inplace(masked, bitmask, vocab_size=49152)
    expected = masked.argmax(dim=-1).to(torch.int32)
    ids = torch.full((8,), POISON, dtype=torch.int32)
    grammar_argmax(logits, bitmask, None, ids, 49152)
    assert torch.equal(ids, expected), seed


@pytest.mark.parametrize("change, named", [
    (lambda c: c.update(logits=c["logits"].double()), "float64"),
    (lambda c: c.update(vocab=5000), "vocab 5000"),
    (lambda c: c.update(bitmask=c["bitmask"][:, :2]), "[8, 2]"),
    (lambda c: c.update(ids=c["ids"].long()), "torch.int64"),
    (lambda c: c.update(rows=torch.tensor([0, 1])), "torch.int64"),
])
def test_mismatches_are_value_errors_naming_them(change, named):
    logits, bitmask, _ = random_case(8, 4096, 0, 0.5)
    case = dict(logits=logits, bitmask=bitmask, rows=None, ids=torch.zeros(8, dtype=torch.int32), vocab=4096)
    change(case)
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        grammar_argmax(case["logits"], case["bitmask"], case["rows"], case["ids"], case["vocab"])
