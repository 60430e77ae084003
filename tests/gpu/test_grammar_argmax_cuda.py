"""kernels.grammar_argmax on the GPU: the kernel against the CPU reference (itself checked against
a loop and xgrammar's masking in tests/test_grammar_argmax.py), token for token, on fresh random
logits and masks of real vocabulary sizes, with ties, -inf and NaN logits, rows that allow nothing
and listed or all rows; the ids of rows not listed are poisoned and must stay so. Also replayed
from a CUDA graph, as the decode step would."""

import pytest
import torch

from kernels.grammar_argmax import grammar_argmax, reference_grammar_argmax

from ..test_grammar_argmax import POISON, random_case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEVICE = torch.device("cuda")


def prepared(batch: int, vocab: int, density: float):
    seed = int(torch.randint(0, 2**31, ()).item())
    logits, bitmask, allowed = random_case(batch, vocab, seed, density)
    logits[0, allowed[0]] = float("-inf")
    logits[1, 5::11] = float("nan")
    bitmask[2] = 0
    return seed, logits, bitmask


@pytest.mark.parametrize("vocab", [49152, 151936, 128256, 262144, 1000, 33])
@pytest.mark.parametrize("density", [0.001, 0.3, 1.0])
@pytest.mark.parametrize("listed", ["all", "some", "one"])
def test_kernel_matches_reference(vocab, density, listed):
    batch = 9
    seed, logits, bitmask = prepared(batch, vocab, density)
    rows = {"all": None, "some": torch.tensor([8, 0, 2, 1, 5], dtype=torch.int32),
            "one": torch.tensor([6], dtype=torch.int32)}[listed]
    expected = torch.full((batch + 3,), POISON, dtype=torch.int32)
    reference_grammar_argmax(logits, bitmask, rows, expected, vocab)
    ids = torch.full((batch + 3,), POISON, dtype=torch.int32, device=DEVICE)
    grammar_argmax(logits.to(DEVICE), bitmask.to(DEVICE), rows.to(DEVICE) if rows is not None else None, ids, vocab)
    torch.cuda.synchronize()
    assert torch.equal(ids.cpu(), expected), (seed, (ids.cpu() != expected).nonzero().flatten().tolist())


@pytest.mark.parametrize("layout", ["row stride past the vocabulary", "unaligned rows"])
def test_kernel_reads_logits_views(layout):
    """Rows 16-byte aligned but wider than the vocabulary (float4 reads, then a scalar tail), or
    starting one element in (scalar reads only)."""
    batch, vocab = 5, 50257
    seed, logits, bitmask = prepared(batch, vocab, 0.5)
    wide = torch.full((batch, vocab + 3), float("nan"), device=DEVICE)
    if layout == "unaligned rows":
        wide = torch.full((batch, vocab + 1), float("nan"), device=DEVICE)
        view = wide[:, 1:]
    else:
        view = wide[:, :vocab]
    view.copy_(logits)
    expected = torch.full((batch,), POISON, dtype=torch.int32)
    reference_grammar_argmax(logits, bitmask, None, expected, vocab)
    ids = torch.full((batch,), POISON, dtype=torch.int32, device=DEVICE)
    grammar_argmax(view, bitmask.to(DEVICE), None, ids, vocab)
    torch.cuda.synchronize()
    assert torch.equal(ids.cpu(), expected), seed


def test_kernel_replays_from_a_graph_over_new_inputs():
    batch, vocab = 64, 49152
    logits = torch.empty(batch, vocab, device=DEVICE)
    bitmask = torch.empty(batch, (vocab + 31) // 32, dtype=torch.int32, device=DEVICE)
    rows = torch.arange(0, batch, 3, dtype=torch.int32, device=DEVICE)
    ids = torch.full((batch,), POISON, dtype=torch.int32, device=DEVICE)
    grammar_argmax(logits.zero_(), bitmask.zero_(), rows, ids, vocab)       # loads and warms the op
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grammar_argmax(logits, bitmask, rows, ids, vocab)
    for _ in range(3):
        seed, fresh_logits, fresh_bitmask = prepared(batch, vocab, 0.2)
        logits.copy_(fresh_logits)
        bitmask.copy_(fresh_bitmask)
        ids.fill_(POISON)
        graph.replay()
        expected = torch.full((batch,), POISON, dtype=torch.int32)
        reference_grammar_argmax(fresh_logits, fresh_bitmask, rows.cpu(), expected, vocab)
        torch.cuda.synchronize()
        assert torch.equal(ids.cpu(), expected), seed


def test_token_masks_never_overwrite_a_mask_before_its_step_read_it():
    """Five fills in a row while the stream that reads them is held up: every fill after the
    second reuses the buffers of the one two before, on the host (whose copy may still wait on
    the masks' own stream) and on the device (which must wait until that mask was read)."""
    import xgrammar as xgr

    from server.engine.grammar import TokenMasks

    vocab = [chr(ord("a") + i) for i in range(26)] + [f"<{i}>" for i in range(38)]
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(vocab))

    class Row:
        is_finished = False

        def __init__(self, letter):
            self.matcher = xgr.GrammarMatcher(compiler.compile_regex(letter))

    masks = TokenMasks(2, len(vocab), DEVICE)
    logits = torch.randn(1, len(vocab), device=DEVICE)
    outs = [torch.full((1,), POISON, dtype=torch.int32, device=DEVICE) for _ in range(5)]
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)                 # about 0.1 s on the current stream
    for letter, ids in zip("abcde", outs):
        masks.argmax_into(logits, masks.fill([Row(letter)]), ids)
    torch.cuda.synchronize()
    assert [vocab[ids.item()] for ids in outs] == list("abcde")
