"""A single token's text and bytes, as log-probability answers name tokens.

The text is the token decoded alone (vLLM's ``decoded_token``; a piece of a multi-byte character
reads as U+FFFD). The bytes are the token's own bytes, which OpenAI's ``bytes`` field carries so
that a client can join the pieces of a character: for byte-level BPE vocabularies (GPT-2, Llama 3,
SmolLM) each character of the vocabulary entry stands for one byte; for SentencePiece ones
``<0xNN>`` is that byte and ``▁`` a space; anything else (special tokens) is its text in UTF-8.
"""

import functools


@functools.lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's reversible map from bytes to printable characters, inverted."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenStrings:
    """Text and bytes of token ids for one tokenizer, each computed once."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None) if backend is not None else None
        self.byte_level = decoder is not None and "ByteLevel" in type(decoder).__name__
        self.special = set(getattr(tokenizer, "all_special_ids", []))
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def text(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            text = self._text[token_id] = self.tokenizer.decode([token_id])
        return text

    def bytes(self, token_id: int) -> list[int]:
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._bytes[token_id] = list(self._raw(token_id))
        return raw

    def _raw(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None or token_id in self.special:
            return self.text(token_id).encode("utf-8")
        if self.byte_level:
            table = _byte_level_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        elif "▁" in piece:
            return piece.replace("▁", " ").encode("utf-8")
        return self.text(token_id).encode("utf-8")


@functools.lru_cache(maxsize=4)
def token_strings(tokenizer) -> TokenStrings:
    return TokenStrings(tokenizer)
