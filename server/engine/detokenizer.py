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
        self._released: str | None = None  # text of tokens[prefix:read], once decoded

    def push(self, token_id: int) -> list[list[int]]:
        """Appends a token; returns the id windows to decode (one or two)."""
        self._tokens.append(token_id)
        window = self._tokens[self._prefix:]
        return [window] if self._released is not None else [self._tokens[self._prefix:self._read], window]

    def advance(self, texts: list[str]) -> str:
        """Takes the decoded windows of ``push``; returns the newly printable text."""
        if self._released is None:
            self._released = texts[0]
        window = texts[-1]
        if len(window) <= len(self._released) or window.endswith("\ufffd"):
            return ""
        delta = window[len(self._released):]
        self._prefix, self._read, self._released = self._read, len(self._tokens), None
        return delta

    def step(self, token_id: int) -> str:
        return step_all([self], [token_id], self.tokenizer)[0]


def step_all(detokenizers: list[IncrementalDetokenizer], token_ids: list[int], tokenizer) -> list[str]:
    """One token for each detokenizer; all windows are decoded in one batched call."""
    windows = [d.push(t) for d, t in zip(detokenizers, token_ids)]
    flat = [w for ws in windows for w in ws]
    backend = getattr(tokenizer, "backend_tokenizer", None)     # the Rust tokenizer: one call, no wrappers
    if backend is not None:
        texts = backend.decode_batch(flat, skip_special_tokens=True)
    else:
        texts = tokenizer.batch_decode(flat, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    out, i = [], 0
    for d, ws in zip(detokenizers, windows):
        out.append(d.advance(texts[i:i + len(ws)]))
        i += len(ws)
    return out


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
