"""Streaming text: what the pieces of a stream add up to, leading spaces after the prompt, and
characters split across tokens."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from models.loader import load_tokenizer
from server.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer("random:smollm2-135m")


def metaspace_tokenizer():
    """A SentencePiece-style tokenizer ("▁" for spaces, byte fallback), as Gemma's and Llama 2's."""
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3, "<0xE2>": 4, "<0x82>": 5, "<0xAC>": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


@pytest.mark.parametrize("seed", range(5))
def test_the_pieces_add_up_to_the_decoded_output(smollm2, seed):
    rng = random.Random(seed)
    text = "".join(rng.choice(["Grüße ", "🚀", "東京", " ok", "—", "a", "\n", "é"]) for _ in range(60))
    prompt = smollm2("The answer:")["input_ids"]
    ids = smollm2(text)["input_ids"] + [rng.randrange(smollm2.vocab_size) for _ in range(40)]
    detok = IncrementalDetokenizer(smollm2, prompt)
    pieces = [detok.step(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces[:len(ids) - 40])
    whole = smollm2.decode(prompt + ids, skip_special_tokens=True)
    assert "".join(pieces) == whole[len(smollm2.decode(prompt)):]


def test_a_leading_space_after_the_prompt_is_kept():
    tok = metaspace_tokenizer()
    assert tok.decode([2]) == "world"                 # alone, the first "▁" is dropped
    detok = IncrementalDetokenizer(tok, prompt_ids=[1])
    assert [detok.step(i) for i in (2, 3)] == [" world", "!"]


def test_a_character_split_over_byte_tokens_comes_out_whole():
    detok = IncrementalDetokenizer(metaspace_tokenizer(), prompt_ids=[1])
    assert [detok.step(i) for i in (4, 5, 6, 2)] == ["", "", "€", " world"]


def test_a_slow_tokenizer_is_refused_naming_it():
    class Slow:
        pass
    with pytest.raises(ValueError, match="fast tokenizer, got Slow"):
        IncrementalDetokenizer(Slow(), [1])
