"""Constrained decoding through xgrammar: grammars compiled against the vocabulary (cached by their
text, on a thread of their own), one matcher per request, and the per-step token bitmask.

A request with a grammar waits outside the scheduler until its grammar is compiled; the others
keep decoding meanwhile. Each step the bitmask rows of the constrained requests are filled on the
CPU (xgrammar's batch matcher, on its threads) while the device runs the step's forward and
copied to the device beside it; greedy rows then take their argmax among the allowed tokens in
one launch (``kernels.grammar_argmax``), other steps mask those rows of the logits before
sampling. The end-of-sequence token is allowed exactly when the grammar accepts what was
generated.
"""

import json
import logging
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import NamedTuple

import torch
import xgrammar as xgr

from kernels.grammar_argmax import grammar_argmax

from .params import GrammarSpec
from .sampler import argmax_rows

log = logging.getLogger(__name__)

# Whitespace only where JSON's usual separators put it (", " and ": "): a small model left free to
# write whitespace can write nothing else until its token limit.
JSON_OPTIONS = dict(any_whitespace=False, strict_mode=True)
JSON_OBJECT = '{"type": "object"}'      # OpenAI's json_object: an object (xgrammar's builtin JSON is any value)
FILL_THREADS = max(1, min(2, (os.cpu_count() or 2) // 2))   # 4 or 8: faster at best, far slower at worst (docs/log.md)
ROWS_PER_FILL_THREAD = 4        # a batch of fewer than twice this fills on one thread
BACKGROUND_FILL_ROWS = 8        # from this many constrained rows the fill runs beside the bookkeeping
COMPILE_ERRORS = (RuntimeError, ValueError, TypeError)       # xgrammar's own errors derive from RuntimeError
_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def _failure(spec: GrammarSpec, exc: Exception) -> ValueError:
    """The library's message without its time stamp and source line."""
    return ValueError(f"the {spec.kind} cannot be compiled: {_SOURCE_PREFIX.sub('', str(exc)).strip()}")


# Formats xgrammar writes more loosely than their standards (it allows 2023-02-31 and 010.0.0.1):
# replaced by patterns that admit only valid values (calendar and leap years included).
_YEAR = r"([1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_LEAP_YEAR = r"([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_DATE = (rf"({_YEAR}-(0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|{_YEAR}-(0[469]|11)-(0[1-9]|[12][0-9]|30)"
         rf"|{_YEAR}-02-(0[1-9]|1[0-9]|2[0-8])|{_LEAP_YEAR}-02-29)")
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]([.][0-9]{1,6}){0,1}(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9][0-9]|[0-9])"
# written without "\." and "?": xgrammar 0.2.9 reads "(\.[0-9]{1,6})?" in a schema's pattern as if the
# dot were optional
# email: the common form, its local part at most 64 characters as RFC 5321 has it, at most four domain
# labels of 32 (xgrammar's lets a model loop in the local part without end)
_EMAIL = r"[A-Za-z0-9_%+-][A-Za-z0-9._%+-]{0,63}@[A-Za-z0-9-]{1,32}([.][A-Za-z0-9-]{1,32}){1,3}"
EXACT_FORMATS = {"date": f"^{_DATE}$", "time": f"^{_TIME}$", "date-time": f"^{_DATE}T{_TIME}$",
                 "ipv4": f"^({_OCTET}[.]){{3}}{_OCTET}$", "email": f"^{_EMAIL}$"}


def _exact_formats(node):
    if isinstance(node, list):
        return [_exact_formats(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: _exact_formats(v) for k, v in node.items()}
    if node.get("format") in EXACT_FORMATS and "pattern" not in node:
        node["pattern"] = EXACT_FORMATS[node.pop("format")]
    return node


def library_schema(text: str) -> str:
    """The schema xgrammar compiles: ``EXACT_FORMATS`` in place of those formats."""
    return json.dumps(_exact_formats(json.loads(text)))


def choice_ebnf(choices: list[str]) -> str:
    """A grammar whose only sentences are ``choices`` (vLLM's guided_choice)."""
    if not choices:
        raise ValueError("choice needs at least one string")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def parse_grammar(spec: GrammarSpec) -> xgr.Grammar:
    """The grammar of ``spec``, without the vocabulary: what a front end checks a request with.
    Raises ValueError naming the problem."""
    try:
        if spec.kind == "json_schema":
            return xgr.Grammar.from_json_schema(library_schema(spec.text), **JSON_OPTIONS)
        if spec.kind == "json_object":
            return xgr.Grammar.from_json_schema(JSON_OBJECT, **JSON_OPTIONS)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.text)
        if spec.kind == "ebnf":
            return xgr.Grammar.from_ebnf(spec.text)
        if spec.kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(spec.text)
    except COMPILE_ERRORS as exc:
        raise _failure(spec, exc) from None
    raise ValueError(f"unknown grammar kind {spec.kind!r}")


class GrammarCompiler:
    """Compiles grammars against the model's vocabulary on a thread of its own, each text once
    (xgrammar's compiler keeps what it compiled)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._compiler: Future = self._executor.submit(self._make_compiler, tokenizer, vocab_size, sorted(stop_ids))

    @staticmethod
    def _make_compiler(tokenizer, vocab_size: int, stop_ids: list[int]) -> xgr.GrammarCompiler:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids)
        return xgr.GrammarCompiler(info, max_threads=FILL_THREADS)

    def compile(self, spec: GrammarSpec) -> Future:
        """A future of the ``xgr.CompiledGrammar``; its exception, a ValueError naming the problem."""
        return self._executor.submit(self._compile, spec)

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        compiler = self._compiler.result()
        try:
            if spec.kind == "json_schema":
                return compiler.compile_json_schema(library_schema(spec.text), **JSON_OPTIONS)
            if spec.kind == "json_object":
                return compiler.compile_json_schema(JSON_OBJECT, **JSON_OPTIONS)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.text)
            if spec.kind == "ebnf":
                return compiler.compile_grammar(spec.text)
            if spec.kind == "structural_tag":
                return compiler.compile_structural_tag(spec.text)
        except COMPILE_ERRORS as exc:
            raise _failure(spec, exc) from None
        raise ValueError(f"unknown grammar kind {spec.kind!r}")

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def new_matcher(compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
    return xgr.GrammarMatcher(compiled)


class DeviceMask(NamedTuple):
    """A step's bitmask where the step reads it, with the indices of the rows it constrains (None:
    every row) and the turn of the buffers it lies in."""
    bitmask: torch.Tensor
    indices: torch.Tensor | None
    turn: int


class TokenMasks:
    """The bitmask of a step's constrained rows: filled on the host, applied on the device.

    Two host buffers take turns (pinned on CUDA), so a fill never overwrites a buffer whose copy
    to the device may still be pending. A batch of ``BACKGROUND_FILL_ROWS`` constrained rows or
    more fills on a thread of its own (xgrammar releases the GIL while it fills), so the engine's
    per-token bookkeeping runs meanwhile; smaller batches fill on the calling thread, where
    handing over costs more than the fill."""

    def __init__(self, max_batch: int, vocab_size: int, device: torch.device, fill_threads: int = FILL_THREADS):
        self.vocab_size = vocab_size
        self.device = device
        pin = device.type == "cuda"
        self._hosts = [xgr.allocate_token_bitmask(max_batch, vocab_size) for _ in range(2)]
        self._rows = [torch.zeros(max_batch, dtype=torch.int32) for _ in range(2)]   # the constrained rows' indices
        if pin:
            self._hosts = [h.pin_memory() for h in self._hosts]
            self._rows = [r.pin_memory() for r in self._rows]
        # On CUDA the device buffers take turns too, copied to on a stream of their own while the
        # step's forward runs; each turn's events: its copy done, its last reader done.
        self._device = ([xgr.allocate_token_bitmask(max_batch, vocab_size).to(device) for _ in range(2)]
                        if pin else None)
        self._device_rows = ([torch.zeros(max_batch, dtype=torch.int32, device=device) for _ in range(2)]
                             if pin else None)
        self._copy_stream = torch.cuda.Stream(device) if pin else None
        self._copied = [torch.cuda.Event() for _ in range(2)] if pin else None
        self._read = [torch.cuda.Event() for _ in range(2)] if pin else None
        self._turn = 0
        # Waking a pool costs more than a few rows' fills (one row: 60 us alone, 270 us through two
        # threads), so small batches fill on one thread.
        self._serial = xgr.BatchGrammarMatcher(1)
        self._pooled = xgr.BatchGrammarMatcher(fill_threads) if fill_threads > 1 else self._serial
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-fill")
        self._filling: Future | None = None       # the last fill started on that thread

    def start_fill(self, seqs) -> "PendingMask | None":
        """Starts filling the bitmask rows of ``seqs`` that have a live matcher (their matchers
        must not change until ``PendingMask.result``); None when no row is constrained."""
        rows = [i for i, s in enumerate(seqs)
                if s.matcher is not None and not s.is_finished and not s.matcher.is_terminated()]
        if not rows:
            return None
        if self._filling is not None:
            wait([self._filling])                 # a step that failed may have left one running
        self._turn ^= 1
        if self._copied is not None:
            self._copied[self._turn].synchronize()   # this turn's last copy has left its host buffers
        host = self._hosts[self._turn]
        matchers = [seqs[i].matcher for i in rows]
        filler = self._pooled if len(rows) >= ROWS_PER_FILL_THREAD * 2 else self._serial
        indices = None
        if len(rows) < len(seqs):
            indices = self._rows[self._turn][:len(rows)]
            indices.numpy()[:] = rows
        if len(rows) >= BACKGROUND_FILL_ROWS:
            done = self._filling = self._background.submit(filler.batch_fill_next_token_bitmask, matchers, host,
                                                           indices=rows)
        else:
            filler.batch_fill_next_token_bitmask(matchers, host, indices=rows)
            done = None
        return PendingMask(self, self._turn, len(seqs), (rows[0], rows[-1] + 1), indices, done)

    def fill(self, seqs) -> DeviceMask | None:
        """The bitmask for ``seqs`` on the device and the indices of the rows it constrains (those
        with a live matcher; None: all), or None when no row is constrained."""
        pending = self.start_fill(seqs)
        return pending.result() if pending is not None else None

    def _to_device(self, turn: int, n: int, span: tuple[int, int], indices: torch.Tensor | None) -> DeviceMask:
        """The first ``n`` rows of the bitmask on the device; only the rows from the first
        constrained one to the last are copied (the others are never read). The copy runs beside
        the step's forward; the current stream waits for it before whatever comes next."""
        host = self._hosts[turn]
        if self._device is None:
            return DeviceMask(host[:n], indices, turn)
        first, end = span
        device, rows = self._device[turn], self._device_rows[turn]
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(self._read[turn])     # the step that last read this turn's buffers
            device[first:end].copy_(host[first:end], non_blocking=True)
            if indices is not None:                 # once, for the mask's application and the argmax
                indices = rows[:indices.shape[0]].copy_(indices, non_blocking=True)
            self._copied[turn].record(self._copy_stream)
        torch.cuda.current_stream(self.device).wait_event(self._copied[turn])
        return DeviceMask(device[:n], indices, turn)

    def _mark_read(self, mask: DeviceMask) -> None:
        if self._read is not None:
            self._read[mask.turn].record(torch.cuda.current_stream(self.device))

    def greedy_ids(self, logits: torch.Tensor, unmasked: torch.Tensor | None, mask: DeviceMask) -> torch.Tensor:
        """The argmax of each row of the masked ``logits``, given ``unmasked``, that of the logits
        before the mask (None: not known): only the constrained rows are searched again."""
        indices = mask.indices
        ids = (argmax_rows(logits) if unmasked is None or indices is None
               else unmasked.index_put((indices,), argmax_rows(logits.index_select(0, indices))))
        self._mark_read(mask)
        return ids

    def argmax_into(self, logits: torch.Tensor, mask: DeviceMask, ids: torch.Tensor) -> None:
        """The argmax of each constrained row of ``logits`` among the tokens its mask allows,
        written into ``ids`` (int32, one per row); the other rows' ids are left as they are."""
        grammar_argmax(logits, mask.bitmask, mask.indices, ids, self.vocab_size)
        self._mark_read(mask)

    def apply(self, logits: torch.Tensor, mask: DeviceMask) -> None:
        """Masked tokens' logits set to -inf, in place, on the rows ``fill`` named."""
        indices = mask.indices
        xgr.apply_token_bitmask_inplace(logits, mask.bitmask, vocab_size=self.vocab_size,
                                        indices=indices.tolist() if indices is not None and self._device is None else indices)
        self._mark_read(mask)

    def warm_up(self) -> None:
        """Applications with and without row indices, and the greedy rows' argmax, so the first
        constrained request does not pay for the kernels' compilation or loading."""
        bitmask = (self._device[0] if self._device is not None else self._hosts[0])[:2]   # one row at --max-batch 1
        logits = torch.zeros(bitmask.shape[0], self.vocab_size, device=self.device)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=self._rows[0][:1])
        ids = torch.zeros(bitmask.shape[0], dtype=torch.int32, device=self.device)
        grammar_argmax(logits, bitmask, self._rows[0][:1].to(self.device), ids, self.vocab_size)


class PendingMask:
    """A step's bitmask being filled (``TokenMasks.start_fill``)."""

    def __init__(self, masks: TokenMasks, turn: int, n: int, span: tuple[int, int],
                 indices: torch.Tensor | None, done: Future | None):
        self._masks, self._turn, self._n, self._span, self._indices, self._done = masks, turn, n, span, indices, done

    def result(self) -> DeviceMask:
        """The filled bitmask on the device and the indices of its rows (``TokenMasks.fill``)."""
        if self._done is not None:
            self._done.result()
        return self._masks._to_device(self._turn, self._n, self._span, self._indices)
