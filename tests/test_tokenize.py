"""The server's prompt encoding: the ids transformers' ``encode`` gives, whether the prompt is
encoded whole or in pieces."""

import random

import pytest
from tokenizers import normalizers, pre_tokenizers

from load_tests.prompts import CORPUS
from models import load_tokenizer
from server.encoding import PromptEncoder, cut_points


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


ALPHABET = list("abcXYZ019 '.,!?-_\t\n\r") + ["  ", "'s", "'ll", " 12", "é", "ß", "東京", "🙂", "½", "\u00a0",
                                                "\u2003", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]


def texts():
    rng = random.Random(11)
    words = CORPUS.split()
    yield ""
    yield "   leading and trailing spaces  \n\n\t"
    yield "digits 1234567 and 3.14159, unicode: naïve café 東京 🙂, tabs\tand\r\nnewlines"
    yield "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    for _ in range(20):
        start = rng.randrange(len(words))
        yield " ".join(words[start:start + rng.randrange(1, 400)])
    for _ in range(300):
        yield "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(1, 200)))


@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize("piece_chars", [2048, 8])
def test_encoding_gives_transformers_ids(tokenizer, add_special_tokens, piece_chars):
    encoder = PromptEncoder(tokenizer, piece_chars=piece_chars, max_pieces=8)
    assert encoder.splittable
    for text in texts():
        assert encoder.encode(text, add_special_tokens) == \
            tokenizer.encode(text, add_special_tokens=add_special_tokens), repr(text[:60])


def test_a_long_prompt_is_cut_where_a_space_follows_a_letter_or_digit(tokenizer):
    text = CORPUS * 2
    pieces = PromptEncoder(tokenizer, max_pieces=4).pieces(text)
    assert len(pieces) == 4 and "".join(pieces) == text
    assert all(p[0] == " " and q[-1].isalnum() for q, p in zip(pieces, pieces[1:]))


def test_cut_points_rise_and_stop_where_no_space_is_left():
    assert cut_points("a b c d e f g h", 4) == [3, 7, 11]
    assert cut_points("ab" * 50 + " x", 4) == [100]
    assert cut_points("x" * 100, 8) == []


def test_a_chat_rendered_prompt_encodes_as_transformers_does(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": CORPUS[:5000]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    encoder = PromptEncoder(tokenizer, piece_chars=512)
    assert len(encoder.pieces(text)) > 1
    assert encoder.encode(text, False) == tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("change", ["normalizer", "prefix space", "no regex", "metaspace"])
def test_a_tokenizer_that_may_split_elsewhere_encodes_whole(change):
    tokenizer = load_tokenizer("default")              # a fresh copy: its backend is changed here
    backend = tokenizer.backend_tokenizer
    if change == "normalizer":
        backend.normalizer = normalizers.Lowercase()
    elif change == "prefix space":
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    elif change == "no regex":
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace()
    encoder = PromptEncoder(tokenizer, piece_chars=8)
    text = CORPUS[:3000]
    assert not encoder.splittable and encoder.pieces(text) == [text]
    assert encoder.encode(text, True) == tokenizer.encode(text)
