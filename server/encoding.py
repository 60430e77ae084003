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

import functools
import os
import re
import threading
from array import array
from collections import OrderedDict

from tokenizers import Encoding, pre_tokenizers

PIECE_CHARS = 2048                     # shorter pieces cost more in per-text overhead than they save
MAX_PIECES = 8
MARK_CHARS = 512                       # with prefix caching, the grid of cuts
CACHED_PROMPTS = 128                   # with prefix caching, the prompts whose ids are kept
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


class PrefixIds:
    """The ids of recent prompts (least recently used dropped first), at each of their marks, and
    which prompt holds the ids of a given text up to a given mark."""

    def __init__(self, capacity: int = CACHED_PROMPTS):
        self.capacity = capacity
        self._lock = threading.Lock()
        self._prompts: OrderedDict[str, tuple[array, dict[int, int]]] = OrderedDict()   # text -> (ids, mark -> ids before)
        self._holder: dict[tuple[int, int], str] = {}        # (mark, hash of the text up to it) -> prompt
        self.query_chars = self.hit_chars = 0

    def longest(self, text: str, text_marks: list[int]) -> tuple[int, array, dict[int, int]]:
        """(m, the ids of text[:m], the ids before each of its marks) for the last of ``text_marks``
        whose text a kept prompt starts with; (0, no ids, {}) if none does."""
        with self._lock:
            self.query_chars += len(text)
            for mark in reversed(text_marks):
                prompt = self._holder.get((mark, hash(text[:mark])))
                if prompt is not None and prompt[:mark] == text[:mark]:
                    ids, counts = self._prompts[prompt]
                    self._prompts.move_to_end(prompt)
                    self.hit_chars += mark
                    return mark, ids[:counts[mark]], {m: n for m, n in counts.items() if m <= mark}
        return 0, array("i"), {}

    def add(self, text: str, ids: array, counts: dict[int, int]) -> None:
        """Keeps ``text``'s ``ids``; ``counts`` maps each of its marks to the ids before it."""
        if not counts:
            return
        with self._lock:
            self._prompts[text] = (ids, counts)
            self._prompts.move_to_end(text)
            for mark in counts:
                self._holder[(mark, hash(text[:mark]))] = text
            while len(self._prompts) > self.capacity:
                old, (_, old_counts) = self._prompts.popitem(last=False)
                for mark in old_counts:
                    key = (mark, hash(old[:mark]))
                    if self._holder.get(key) == old:
                        del self._holder[key]

    def __len__(self) -> int:
        return len(self._prompts)

    def check(self) -> None:
        """Raises AssertionError unless every index entry names a kept prompt that has that mark."""
        with self._lock:
            for (mark, _), prompt in self._holder.items():
                assert prompt in self._prompts and mark in self._prompts[prompt][1]


class PromptEncoder:
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
        if self.backend is None:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        if self.prefixes is not None:
            return self._encode_after_kept_prefix(text)
        with self._lock:
            alone = self._in_flight == 0
            self._in_flight += 1
        try:
            # Beside other encodes the cores are taken: pieces would only add their overhead.
            pieces = self.pieces(text) if alone else [text]
            if len(pieces) == 1:
                return self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
            parts = self.backend.encode_batch_fast(pieces, add_special_tokens=False)
            whole = Encoding.merge(parts, growing_offsets=False)
            return self.backend.post_process(whole, add_special_tokens=add_special_tokens).ids
        finally:
            with self._lock:
                self._in_flight -= 1

    def _encode_after_kept_prefix(self, text: str) -> list[int]:
        text_marks = marks(text, 0, self.mark_chars)
        start, ids, counts = self.prefixes.longest(text, text_marks)
        bounds = [start, *(m for m in text_marks if m > start), len(text)]
        parts = self.backend.encode_batch_fast([text[a:b] for a, b in zip(bounds, bounds[1:])],
                                               add_special_tokens=False)
        for mark, part in zip(bounds[1:], parts):
            ids.extend(part.ids)
            counts[mark] = len(ids)
        del counts[len(text)]
        self.prefixes.add(text, ids, counts)
        return ids.tolist()


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@functools.cache
def prompt_encoder(tokenizer, prefix_caching: bool) -> PromptEncoder:
    return PromptEncoder(tokenizer, cached_prompts=CACHED_PROMPTS if prefix_caching else 0)
