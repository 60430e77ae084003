"""Text out of token ids, one token at a time: tokenizers' ``DecodeStream`` per request, primed
with the prompt's last ids (for leading-space rules). It releases text only once it no longer
ends in a partial UTF-8 character, so a multi-byte character split across tokens is never emitted
broken; stop strings are found in the released text by ``StopMatcher``.
"""

from tokenizers.decoders import DecodeStream

PROMPT_CONTEXT = 5      # prompt tokens decoded with the first outputs, for leading-space rules


def backend_of(tokenizer):
    """The Rust tokenizer behind a transformers fast tokenizer; a slow one is refused."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"streaming text needs a fast tokenizer, got {type(tokenizer).__name__}")
    return backend


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int]):
        self._backend = backend_of(tokenizer)
        self._stream = DecodeStream(ids=list(prompt_ids[-PROMPT_CONTEXT:]), skip_special_tokens=True)

    def step(self, token_id: int) -> str:
        """The text this token makes printable ("" while a character is incomplete)."""
        return self._stream.step(self._backend, token_id) or ""


class StopMatcher:
    """Finds stop strings in the growing text and holds back any tail that could still begin one."""

    def __init__(self, stops: tuple[str, ...], include: bool = False):
        """``include``: a match cuts the text after the stop string instead of before it."""
        self.stops = tuple(s for s in stops if s)
        self.include = include
        self._hold = max((len(s) for s in self.stops), default=1) - 1

    def scan(self, text: str, emitted: int, added: int, may_stop: bool = True) -> tuple[int, bool]:
        """Given the whole ``text``, of which ``emitted`` chars were released and the last
        ``added`` are new: returns (how far text may now be released, whether a stop matched,
        in which case text must be cut at that point, at the first stop string found). Not
        ``may_stop`` (before min_tokens): the tail is held back all the same, and nothing matches."""
        if not self.stops:
            return len(text), False
        if may_stop:
            lo = max(0, len(text) - added - self._hold)
            found = [(i, s) for s in self.stops if (i := text.find(s, lo)) >= 0]
            if found:
                start, stop = min(found, key=lambda f: f[0])
                return start + len(stop) if self.include else start, True
        return max(emitted, len(text) - self._hold), False
