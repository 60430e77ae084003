"""The server's prompt encoding: the fast backend call gives the ids transformers' ``encode`` gives."""

import random

import pytest

from load_tests.prompts import CORPUS
from models import load_tokenizer
from server.generation import _encode


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


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


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_fast_encode_gives_transformers_ids(tokenizer, add_special_tokens):
    for text in texts():
        assert _encode(tokenizer, text, add_special_tokens) == \
            tokenizer.encode(text, add_special_tokens=add_special_tokens), repr(text[:60])


def test_a_chat_rendered_prompt_encodes_as_transformers_does(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": CORPUS[:2000]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert _encode(tokenizer, text, False) == tokenizer.encode(text, add_special_tokens=False)
