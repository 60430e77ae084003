"""The server's prompt encoding: the ids transformers' ``encode`` gives, whether the prompt is
encoded whole, in pieces, or after the kept ids of an earlier prompt's start."""

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from tokenizers import normalizers, pre_tokenizers, processors

from load_tests.prompts import CORPUS
from models import load_tokenizer
from server.encoding import PromptEncoder, cut_points, marks, prompt_encoder


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


def test_texts_that_start_alike_share_their_marks_inside_the_common_start():
    rng = random.Random(5)
    for _ in range(200):
        common = "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(0, 300)))
        a = common + "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(0, 100)))
        b = common + "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(0, 100)))
        inside = [m for m in marks(a, 0, 16) if m < len(common)]
        assert inside == [m for m in marks(b, 0, 16) if m < len(common)]
        for start in inside:                 # resuming at a mark finds the same later marks
            assert marks(a, start, 16) == [m for m in marks(a, 0, 16) if m > start]


def prompts_sharing_starts(rng, count):
    """Prompts that start with part of one of the last few (or all of it), then go their own way."""
    words = CORPUS.split()
    made = []
    for _ in range(count):
        if made and rng.random() < 0.8:
            earlier = rng.choice(made[-8:])
            cut = rng.randrange(len(earlier) + 1)
            own = " ".join(rng.choice(words) for _ in range(rng.randrange(0, 40)))
            tail = "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(0, 20)))
            made.append(earlier[:cut] + rng.choice(["", " ", "\n"]) + own + tail)
        else:
            start = rng.randrange(len(words))
            made.append(" ".join(words[start:start + rng.randrange(1, 300)]))
    return made


@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize("busy", [False, True])
def test_prompts_that_start_as_kept_ones_did_encode_as_transformers_does(tokenizer, add_special_tokens, busy):
    encoder = PromptEncoder(tokenizer, cached_prompts=6, mark_chars=32)
    encoder._in_flight = int(busy)        # beside another encode: two pieces, the ids kept at one mark
    prompts = prompts_sharing_starts(random.Random(7), 300)
    for text in prompts:
        assert encoder.encode(text, add_special_tokens) == \
            tokenizer.encode(text, add_special_tokens=add_special_tokens), repr(text[:60])
        assert len(encoder.prefixes) <= 6
    encoder.prefixes.check()
    kept = encoder.prefixes
    # busy, a prompt is found again whole, or by the shared starts it took from earlier ones
    assert kept.hit_chars > kept.query_chars / (40 if busy else 4), (kept.hit_chars, kept.query_chars)


def test_encodes_from_many_threads_at_once_give_transformers_ids(tokenizer):
    encoder = PromptEncoder(tokenizer, cached_prompts=8, mark_chars=32)
    prompts = prompts_sharing_starts(random.Random(9), 200)
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda text: encoder.encode(text, True), prompts))
    assert got == [tokenizer.encode(text) for text in prompts]
    encoder.prefixes.check()
    assert encoder.prefixes.hit_chars > 0


def test_the_same_prompt_twice_encodes_only_past_its_last_mark(tokenizer):
    encoder = PromptEncoder(tokenizer, cached_prompts=4, mark_chars=512)
    text = CORPUS[:6000]
    first = encoder.encode(text, True)
    assert encoder.prefixes.hit_chars == 0
    assert encoder.encode(text, True) == first == tokenizer.encode(text)
    assert encoder.prefixes.hit_chars == marks(text)[-1] > len(text) - 600


def test_a_prompt_not_shared_neither_uses_nor_joins_the_kept_prompts(tokenizer):
    encoder = PromptEncoder(tokenizer, cached_prompts=4, mark_chars=512)
    text, expected = CORPUS[:6000], tokenizer.encode(CORPUS[:6000])
    assert encoder.encode_counted(text, True, shared=False) == (expected, 0)
    assert len(encoder.prefixes) == 0
    encoder.encode(text, True)
    assert encoder.encode_counted(text, True, shared=False) == (expected, 0)
    assert encoder.prefixes.hit_chars == 0 and encoder.encode_counted(text, True)[1] > 0


def test_a_prompt_kept_again_and_dropped_leaves_no_index_entry(tokenizer):
    encoder = PromptEncoder(tokenizer, cached_prompts=2, mark_chars=64)
    texts = [CORPUS[i * 700:i * 700 + 1400] for i in range(5)]
    for text in texts[:1] * 3 + texts[1:] + texts[:1]:
        copy = "".join(list(text))                  # an equal text, another object
        assert encoder.encode(copy, True) == tokenizer.encode(text)
        encoder.prefixes.check()


def test_a_growing_conversation_reuses_the_turns_before(tokenizer):
    encoder = PromptEncoder(tokenizer, cached_prompts=4, mark_chars=64)
    rng = random.Random(3)
    messages = [{"role": "system", "content": CORPUS[:1500]}]
    previous = ""
    for turn in range(6):
        messages.append({"role": "user", "content": CORPUS[rng.randrange(3000):][:400]})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        before = encoder.prefixes.hit_chars
        assert encoder.encode(text, False) == tokenizer.encode(text, add_special_tokens=False)
        assert text.startswith(previous) and encoder.prefixes.hit_chars - before > len(previous) - 200
        previous = text[:-len("<|im_start|>assistant\n")]
        messages.append({"role": "assistant", "content": CORPUS[rng.randrange(3000):][:200]})


def test_ids_are_not_kept_where_encoding_adds_special_tokens():
    tokenizer = load_tokenizer("default")
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    encoder = PromptEncoder(tokenizer, cached_prompts=4)
    assert encoder.splittable and encoder.prefixes is None
    text = CORPUS[:3000]
    assert encoder.encode(text, True)[0] == 0
    assert encoder.encode(text, True) == tokenizer.backend_tokenizer.encode(text).ids


def test_the_server_keeps_prompt_ids_only_with_prefix_caching(tokenizer):
    assert prompt_encoder(tokenizer, True).prefixes is not None
    assert prompt_encoder(tokenizer, False).prefixes is None
    text = CORPUS[:4000]
    for caching in (True, False):
        encoder = prompt_encoder(tokenizer, caching)
        encoder.encode_counted(text, True)
        ids, reused = encoder.encode_counted(text, True)
        assert ids == tokenizer.encode(text) and (reused > 3000) == caching


def test_what_follows_a_kept_start_is_small_enough_to_encode_where_it_is(tokenizer):
    encoder = PromptEncoder(tokenizer, cached_prompts=4, mark_chars=512)
    shared = CORPUS[:8000]
    cold = encoder.prepare(shared + CORPUS[9000:9600], True)
    assert cold.chars == len(cold.text) and not cold.small      # nothing kept yet: off the event loop
    assert encoder.run(cold) == (tokenizer.encode(cold.text), 0)
    text = shared + CORPUS[12000:12600]
    warm = encoder.prepare(text, True)
    assert warm.small and 0 < warm.chars < 1200                 # the new tail and at most a mark's span before it
    ids, reused = encoder.run(warm)
    assert ids == tokenizer.encode(text) and reused == len(text) - warm.chars
    assert encoder.prepare(text, True, shared=False).chars == len(text)
    assert encoder.prepare(CORPUS[:300], True).small and PromptEncoder(tokenizer).prepare(CORPUS[:300], True).small
