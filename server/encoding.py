"""Prompt text to token ids, a long prompt's pieces encoded in parallel.

A fast tokenizer's backend encodes without character offsets (which the server never reads: 15-20 %
of a long prompt's encode) and without holding the GIL. Its pre-tokenizer's regex is most of the
rest, and it runs on one thread per text; so a long prompt is cut into pieces where that regex
would cut it anyway, the pieces go to the backend as one batch (its thread pool encodes them side
by side), and the pieces' encodings are joined and post-processed as the whole text's would be.

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

from tokenizers import Encoding, pre_tokenizers

PIECE_CHARS = 2048                     # shorter pieces cost more in per-text overhead than they save
MAX_PIECES = 8
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


class PromptEncoder:
    def __init__(self, tokenizer, piece_chars: int = PIECE_CHARS, max_pieces: int | None = None):
        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.splittable = self.backend is not None and splits_like_gpt2(self.backend)
        self.piece_chars = piece_chars
        self.max_pieces = max_pieces or min(MAX_PIECES, _cpus())
        self._lock = threading.Lock()
        self._in_flight = 0

    def pieces(self, text: str) -> list[str]:
        count = min(self.max_pieces, len(text) // self.piece_chars) if self.splittable else 1
        bounds = [0, *cut_points(text, count), len(text)] if count > 1 else [0, len(text)]
        return [text[a:b] for a, b in zip(bounds, bounds[1:])]

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.backend is None:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
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


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@functools.cache
def prompt_encoder(tokenizer) -> PromptEncoder:
    return PromptEncoder(tokenizer)
