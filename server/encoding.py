"""Prompt text to token ids: a long prompt's pieces encoded in parallel, and with prefix caching a
prompt's start that an earlier prompt shared not encoded again.

A fast tokenizer's backend encodes without character offsets (which the server never reads: 15-20 %
of a long prompt's encode) and without holding the GIL. Its pre-tokenizer's regex is most of the
rest, and it runs on one thread per text; so a long prompt is cut into pieces where that regex
would cut it anyway, the pieces go to the backend as one batch (its thread pool encodes them side
by side), and the pieces' encodings are joined and post-processed as the whole text's would be.

With prefix caching on, the cuts fall on a grid instead (``marks``), so that two prompts that
start with the same text share the cuts inside it, and the ids up to each cut of recent prompts
are kept (``PrefixIds``): a prompt that starts as one of them did (a shared system prompt, the
conversation so far) encodes only what follows the last shared cut, as its KV blocks are only
computed past the last shared block.

Where the regex cuts is known for the byte-level pattern of GPT-2 (SmolLM2's tokenizer), with no
normalizer and no added token that holds or strips whitespace: every match that holds a
non-whitespace character ends before a space that follows it, and no match looks behind, so a
space after a letter or digit starts a match whatever precedes it. Every other tokenizer encodes
the text whole.
"""

import contextlib
import functools
import os
import re
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from tokenizers import Encoding, pre_tokenizers

PIECE_CHARS = 2048                     # shorter pieces cost more in per-text overhead than they save
MAX_PIECES = 8
MARK_CHARS = 512                       # with prefix caching, the grid of cuts
CACHED_PROMPTS = 128                   # with prefix caching, the prompts whose ids are kept
INLINE_CHARS = 2048                    # a text this short is encoded on the caller's thread (EncodeWork.small)
_CUT = re.compile(r"(?<=[^\W_]) ")     # a space after a letter or digit


def splits_like_gpt2(backend) -> bool:
    """Whether ``backend`` (a ``tokenizers.Tokenizer``) tokenizes a text as the concatenation of its
    pieces when the text is cut before a space that follows a letter or digit."""
    pre = backend.pre_tokenizer
    if not (isinstance(pre, pre_tokenizers.ByteLevel) and pre.use_regex and not pre.add_prefix_space):
        return False
    if backend.normalizer is not None or backend.truncation is not None or backend.padding is not None:
        return False
    return not any(t.lstrip or t.rstrip or t.single_word or any(c.isspace() for c in t.content)
                   for t in backend.get_added_tokens_decoder().values())


def cut_points(text: str, pieces: int) -> list[int]:
    """Up to ``pieces - 1`` positions of ``_CUT`` spaces, near equal shares of ``text`` apart."""
    points, start = [], 0
    for k in range(1, pieces):
        match = _CUT.search(text, max(start + 1, k * len(text) // pieces))
        if match is None:
            break
        start = match.start()
        points.append(start)
    return points


def marks(text: str, start: int = 0, spacing: int = MARK_CHARS) -> list[int]:
    """The cuts of ``text`` after ``start`` (itself 0 or a mark) on a grid: the first ``_CUT`` space
    at or after each multiple of ``spacing`` that no earlier mark passed. A mark depends only on
    the text up to it, so texts that start alike have the same marks inside their common start."""
    points, position = [], spacing * (start // spacing + 1)
    while (match := _CUT.search(text, position)) is not None:
        points.append(match.start())
        position = spacing * (match.start() // spacing + 1)
    return points


def chained_keys(text: str, text_marks: list[int]) -> list[int]:
    """A key for the text up to each mark, each from the one before and the text between them:
    texts that start alike get the same keys for their common marks, in one pass over the text."""
    keys, key, previous = [], 0, 0
    for mark in text_marks:
        key = hash((key, text[previous:mark]))
        keys.append(key)
        previous = mark
    return keys


class PrefixIds:
    """The ids of recent prompts (least recently used dropped first) before each of their marks,
    found by the key of the text up to a mark; a hit is checked against the kept text itself."""

    def __init__(self, capacity: int = CACHED_PROMPTS):
        self.capacity = capacity
        self._lock = threading.Lock()
        # text -> (its ids, mark -> (ids before it, its key))
        self._prompts: OrderedDict[str, tuple[array, dict[int, tuple[int, int]]]] = OrderedDict()
        self._holder: dict[int, str] = {}                    # key -> the kept prompt holding it
        self.query_chars = self.hit_chars = 0

    def longest(self, text: str, text_marks: list[int], keys: list[int]) -> tuple[int, array, dict]:
        """For the last of ``text_marks`` up to which a kept prompt has the same text: that mark, the
        ids before it, and (ids before, key) of each mark up to it; (0, no ids, {}) if none."""
        with self._lock:
            self.query_chars += len(text)
            for mark, key in zip(reversed(text_marks), reversed(keys)):
                prompt = self._holder.get(key)
                if prompt is not None and prompt[:mark] == text[:mark]:
                    ids, kept = self._prompts[prompt]
                    self._prompts.move_to_end(prompt)
                    self.hit_chars += mark
                    return mark, ids[:kept[mark][0]], {m: v for m, v in kept.items() if m <= mark}
        return 0, array("i"), {}

    def add(self, text: str, ids: array, kept: dict[int, tuple[int, int]]) -> None:
        """Keeps ``text``'s ``ids``; ``kept`` maps marks of it to (ids before it, its key)."""
        if not kept:
            return
        with self._lock:
            self._prompts[text] = (ids, kept)
            self._prompts.move_to_end(text)
            for _, key in kept.values():
                self._holder[key] = text
            while len(self._prompts) > self.capacity:
                old, (_, old_kept) = self._prompts.popitem(last=False)
                for _, key in old_kept.values():
                    if self._holder.get(key) == old:
                        del self._holder[key]

    def __len__(self) -> int:
        return len(self._prompts)

    def check(self) -> None:
        """Raises AssertionError unless every key names a kept prompt that holds it."""
        with self._lock:
            for key, prompt in self._holder.items():
                assert prompt in self._prompts and key in (k for _, k in self._prompts[prompt][1].values())


class PromptEncoder:
    """A tokenizer's encode for the server: the text whole, in pieces side by side, or (with
    ``cached_prompts``) after the kept ids of its start. The ids are always the tokenizer's own."""

    def __init__(self, tokenizer, piece_chars: int = PIECE_CHARS, max_pieces: int | None = None,
                 cached_prompts: int = 0, mark_chars: int = MARK_CHARS):
        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.splittable = self.backend is not None and splits_like_gpt2(self.backend)
        self.piece_chars = piece_chars
        self.max_pieces = max_pieces or min(MAX_PIECES, _cpus())
        self.mark_chars = mark_chars
        # Kept ids stand for the text alone, so they serve only where encoding adds no special token.
        reusable = self.splittable and cached_prompts > 0 and self.backend.num_special_tokens_to_add(False) == 0
        self.prefixes = PrefixIds(cached_prompts) if reusable else None
        self._lock = threading.Lock()
        self._in_flight = 0

    def pieces(self, text: str) -> list[str]:
        count = min(self.max_pieces, len(text) // self.piece_chars) if self.splittable else 1
        bounds = [0, *cut_points(text, count), len(text)] if count > 1 else [0, len(text)]
        return [text[a:b] for a, b in zip(bounds, bounds[1:])]

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.encode_counted(text, add_special_tokens)[0]

    def encode_counted(self, text: str, add_special_tokens: bool, shared: bool = True) -> tuple[list[int], int]:
        """The ids of ``text``, and how many of its characters a kept prompt's ids served."""
        return self.run(self.prepare(text, add_special_tokens, shared))

    def prepare(self, text: str, add_special_tokens: bool, shared: bool = True) -> "EncodeWork":
        """What encoding ``text`` takes: with kept prompts, the longest start of it one of them
        shares is found here (Python work in proportion to the text, no encoding). Not ``shared``
        (a request with a ``cache_salt``): the text neither uses nor joins the kept prompts, so
        its encode time says nothing about what others sent."""
        if self.backend is not None and self.prefixes is not None and shared:
            text_marks = marks(text, 0, self.mark_chars)
            if len(text_marks) >= 2:                 # else keeping it would cost more than it saves
                keys = chained_keys(text, text_marks)
                start, ids, kept = self.prefixes.longest(text, text_marks, keys)
                return EncodeWork(text, add_special_tokens, _KeptStart(text_marks, keys, start, ids, kept))
        return EncodeWork(text, add_special_tokens)

    def run(self, work: "EncodeWork") -> tuple[list[int], int]:
        """The ids of ``work``'s text, and how many of its characters kept ids served."""
        if self.backend is None:
            return list(self.tokenizer.encode(work.text, add_special_tokens=work.add_special_tokens)), 0
        if work.kept is None:
            return self._encode_fresh(work.text, work.add_special_tokens), 0
        return self._encode_after(work.text, work.kept), work.kept.start

    def _encode_fresh(self, text: str, add_special_tokens: bool) -> list[int]:
        with self._turn() as alone:
            pieces = self.pieces(text) if alone else [text]
            if len(pieces) == 1:
                return self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
            parts = self.backend.encode_batch_fast(pieces, add_special_tokens=False)
        whole = Encoding.merge(parts, growing_offsets=False)
        return self.backend.post_process(whole, add_special_tokens=add_special_tokens).ids

    @contextlib.contextmanager
    def _turn(self):
        """Whether no other encode runs in this process: beside others the cores are taken, and
        pieces would only add their overhead."""
        with self._lock:
            alone = self._in_flight == 0
            self._in_flight += 1
        try:
            yield alone
        finally:
            with self._lock:
                self._in_flight -= 1

    def _encode_after(self, text: str, found: "_KeptStart") -> list[int]:
        """``text`` encoded from the end of its kept start on, its ids and marks kept in turn."""
        ids, kept = found.ids, found.kept
        after = [m for m in found.marks if m > found.start]
        with self._turn() as alone:
            cuts = after if alone else after[-1:]     # the last mark alone still finds the whole text again
            bounds = [found.start, *cuts, len(text)]
            parts = self.backend.encode_batch_fast([text[a:b] for a, b in zip(bounds, bounds[1:])],
                                                   add_special_tokens=False)
        key_of = dict(zip(found.marks, found.keys))
        for mark, part in zip(cuts, parts):
            ids.extend(part.ids)
            kept[mark] = (len(ids), key_of[mark])
        ids.extend(parts[-1].ids)
        self.prefixes.add(text, ids, kept)
        return ids.tolist()


@dataclass
class _KeptStart:
    marks: list[int]
    keys: list[int]
    start: int                          # the mark up to which a kept prompt shares the text (0: none)
    ids: array                          # the ids before it
    kept: dict[int, tuple[int, int]]    # mark -> (ids before it, its key), up to start


@dataclass
class EncodeWork:
    """A prompt's encode, prepared (``PromptEncoder.prepare``)."""
    text: str
    add_special_tokens: bool
    kept: _KeptStart | None = None

    @property
    def chars(self) -> int:
        """What the tokenizer still has to encode of the text."""
        return len(self.text) - (self.kept.start if self.kept is not None else 0)

    @property
    def small(self) -> bool:
        """Cheaper to encode where it is (about 1 ms at most) than to hand to a thread and back,
        which, beside an event loop busy streaming tokens, waits milliseconds for the GIL."""
        return self.chars <= INLINE_CHARS


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@functools.cache
def prompt_encoder(tokenizer, prefix_caching: bool) -> PromptEncoder:
    return PromptEncoder(tokenizer, cached_prompts=CACHED_PROMPTS if prefix_caching else 0)
