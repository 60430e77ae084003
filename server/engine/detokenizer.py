"""Text out of token ids, one token at a time, without re-decoding the whole output.

Only a short window of recent tokens is decoded per step; text is released only once it no
longer ends in a partial UTF-8 character (the replacement character), so a multi-byte
character split across tokens is never emitted broken.
"""

PROMPT_CONTEXT = 5      # prompt tokens decoded with the first outputs, for leading-space rules


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self._tokens = list(prompt_ids[-PROMPT_CONTEXT:])
        self._prefix = 0                 # start of the window decoded for comparison
        self._read = len(self._tokens)   # tokens whose text has been released

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def step(self, token_id: int) -> str:
        self._tokens.append(token_id)
        released = self._decode(self._tokens[self._prefix:self._read])
        window = self._decode(self._tokens[self._prefix:])
        if len(window) <= len(released) or window.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._tokens)
        return window[len(released):]


class StopMatcher:
    """Finds stop strings in the growing text and holds back any tail that could still begin one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self.stops), default=1) - 1

    def scan(self, text: str, emitted: int, added: int) -> tuple[int, bool]:
        """Given the whole ``text``, of which ``emitted`` chars were released and the last
        ``added`` are new: returns (how far text may now be released, whether a stop matched,
        in which case text must be cut at that point)."""
        if not self.stops:
            return len(text), False
        lo = max(0, len(text) - added - self._hold)
        cut = min((i for i in (text.find(s, lo) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            return cut, True
        return max(emitted, len(text) - self._hold), False
