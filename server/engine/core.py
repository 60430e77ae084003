"""The engine core: scheduler, KV pool, model runner and sampler, stepping in one thread.

It takes requests and aborts from an inbox and hands every step's events, tagged with their
request ids, to ``publish`` together with a snapshot of its state. Events carry token ids; the
front end makes the text (``output.py``). It runs in a thread of the
server (``Engine``) or in a process of its own (``ProcessEngine``); it never sees asyncio.
"""

import gc
import itertools
import logging
import queue
import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Callable

import torch

from models import LoadedModel

from .block_manager import BlockManager
from .config import EngineConfig
from .grammar import GrammarCompiler, new_matcher
from .model_runner import ModelRunner
from .params import FinishEvent, SamplingParams, TokenEvent
from .pipeline import Sampled
from .prefill_budget import PrefillCost
from .prefill_budget import measure as measure_prefill
from .sampler import SamplingRows
from .scheduler import PrefillStep, Scheduler
from .sequence import Sequence, Status

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.5
COMPILE_POLL_S = 0.01        # with nothing else to do, how long a step waits for a grammar being compiled
STATS_LOG_INTERVAL_S = 5.0


class StepStats:
    """Counts for the periodic throughput log line (as vLLM's server logs one)."""

    def __init__(self):
        self.reset(time.monotonic())

    def reset(self, now: float) -> None:
        self.since = now
        self.decode_steps = self.prefill_steps = self.prompt_tokens = self.generated = 0
        self.decode_s = self.prefill_s = self.device_wait_s = 0.0

    def add_time(self, counts_before: tuple[int, int], seconds: float) -> None:
        """A step's wall time, its events' hand-off included, given the (decode, prefill) step
        counts from before it; a call that only read back the last tokens counts for neither."""
        if self.prefill_steps > counts_before[1]:
            self.prefill_s += seconds
        elif self.decode_steps > counts_before[0]:
            self.decode_s += seconds

    def line(self, now: float, running: int, waiting: int, kv_used: float) -> str:
        span = max(now - self.since, 1e-9)
        steps = self.decode_steps + self.prefill_steps
        return (f"prompt {self.prompt_tokens / span:.0f} tok/s, generation {self.generated / span:.0f} tok/s; "
                f"{self.decode_steps / span:.0f} decode steps/s at {1e3 * self.decode_s / max(self.decode_steps, 1):.2f} ms"
                f" + {self.prefill_steps / span:.1f} prefill steps/s at "
                f"{1e3 * self.prefill_s / max(self.prefill_steps, 1):.2f} ms, waiting for the device "
                f"{1e3 * self.device_wait_s / max(steps, 1):.2f} ms per step; running {running}, waiting {waiting}, "
                f"KV cache {100 * kv_used:.1f}% used")


MAX_FAILED_STEPS = 3


@dataclass
class EngineStats:
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    preemptions: int
    kv_blocks_cached: int = 0            # blocks holding a cached prefix that no request holds
    prefix_cache_queries: int = 0        # prompt tokens looked up in the prefix cache (cumulative)
    prefix_cache_hits: int = 0           # of those, found there
    sampled_tokens: int = 0              # tokens given to requests, counted as each step's arrive (cumulative)


@dataclass(frozen=True)
class ModelInfo:
    """What a front end needs to know of the model the core serves."""
    model_name: str
    max_model_len: int
    kv_tokens: int
    block_size: int
    num_blocks: int
    vocab_size: int                 # rows of the input embedding: a prompt's ids must be below it


Publish = Callable[[list[tuple[str, object]], EngineStats], None]


class EngineCore:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, publish: Publish):
        self.config = config
        self.tokenizer = loaded.tokenizer
        self.max_model_len = min(loaded.max_model_len, config.max_model_len or loaded.max_model_len)
        self.eos_ids = loaded.eos_token_ids
        self.special_ids = set(getattr(self.tokenizer, "all_special_ids", []))
        self.publish = publish
        started = time.monotonic()
        self.runner = ModelRunner(loaded, config, self.max_model_len)
        if self.runner.kv_tokens < self.max_model_len:      # a pool sized by --num-blocks or the CPU's token budget
            log.warning("the KV pool holds %d tokens, fewer than the context length of %d: the context served "
                        "(and advertised) is %d tokens", self.runner.kv_tokens, self.max_model_len,
                        self.runner.kv_tokens)
            self.max_model_len = self.runner.kv_tokens
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size, config.prefix_caching,
                                   salt=f"{loaded.name}|{loaded.dtype}")
        prefill_cost = self._measure_prefill() if loaded.device.type == "cpu" and config.cpu_prefill_step_s else None
        self.scheduler = Scheduler(self.blocks, config.max_batch, config.max_prefill_tokens, self.max_model_len,
                                   config.prefill_delay_steps, config.chained_prefill_tokens,
                                   prefill_cost, config.cpu_prefill_step_s)
        self.steps = 0
        self.step_stats = StepStats()
        # structured output: requests whose grammar is being compiled, kept out of the scheduler till then
        self.grammars = GrammarCompiler(self.tokenizer, self.runner.token_masks.vocab_size, self.eos_ids)
        self.compiling: dict[Sequence, Future] = {}
        self.constrained = 0                 # admitted requests with a grammar, not finished
        self.sampled_tokens = 0
        self.info = ModelInfo(loaded.name, self.max_model_len, self.runner.kv_tokens, config.block_size,
                              self.blocks.num_blocks, loaded.model.get_input_embeddings().num_embeddings)
        if loaded.device.type == "cuda":
            self.runner.token_masks.warm_up()
            self._warm_up()
        graphs = self.runner.prefill_graphs
        if config.prefix_caching:
            log.info("prefix caching on (--no-prefix-caching turns it off)%s",
                     f"; a prefill after a cached prefix replays a graph up to {graphs.key_row_buckets[-1]} "
                     "key rows, and runs eagerly past that" if graphs is not None else "")
        else:
            log.info("prefix caching off")
        log.info("KV pool: %d blocks of %d tokens (%d tokens); graph buckets %s, captured in %.1f s; "
                 "engine ready in %.1f s", self.blocks.num_blocks, config.block_size, self.runner.kv_tokens,
                 sorted(self.runner.graphs) or "none", self.runner.capture_seconds, time.monotonic() - started)

    def _measure_prefill(self) -> PrefillCost:
        """The CPU's prefill speed, timed now, before any request, on the pool's first blocks."""
        limit = min(self.runner.kv_tokens, self.max_model_len)
        cost = measure_prefill(self.runner.prefill_seconds, limit)
        step_s = self.config.cpu_prefill_step_s
        long = min(4096, limit)
        log.info("CPU prefill: %.2f ms a token, %.2f us more per cached token it attends to: a prefill step "
                 "takes up to %d prompt tokens at the start of a prompt, %d after %d cached, to last about "
                 "%.0f ms (cpu_prefill_step_s; max_prefill_tokens %d)",
                 cost.per_token_s * 1e3, cost.per_key_s * 1e6,
                 min(cost.tokens_within(step_s, 0), self.config.max_prefill_tokens),
                 min(cost.tokens_within(step_s, long), self.config.max_prefill_tokens), long, step_s * 1e3,
                 self.config.max_prefill_tokens)
        return cost

    def _warm_up(self) -> None:
        """A few throwaway requests through every path (prefill, decode graphs, sampling), so the
        first real request does not pay for lazily loaded kernels and library set-up."""
        new_tokens = 4
        longest = min(100, self.max_model_len, self.runner.kv_tokens) - new_tokens
        for i, length in enumerate(sorted({min(7, longest), longest})):
            if length >= 1:
                self.add(f"warm-up-{i}", list(range(10, 10 + length)),
                         SamplingParams(max_new_tokens=new_tokens, ignore_eos=True), seed=i)
        for _ in range(1000):                      # events dropped: nobody is listening
            if not self.busy():
                break
            self.step()
        for seq in list(itertools.chain(self.scheduler.running, self.scheduler.waiting)):
            self._finish(seq, "abort")             # only if the pool could not hold them
        self.runner.pipeline.drop()
        self.steps = self.sampled_tokens = 0
        self.blocks.query_tokens = self.blocks.hit_tokens = 0

    def stats(self) -> EngineStats:
        b = self.blocks
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), b.num_blocks, b.num_used,
                           self.scheduler.preemptions, b.num_cached_idle, b.query_tokens, b.hit_tokens,
                           self.sampled_tokens)

    def run(self, inbox) -> None:
        """Steps until a ``("stop", None)`` message. Inbox messages:
        ``("add", (request_id, prompt_ids, params, seed, follows))`` and ``("abort", request_id)``.
        A step that raises fails the requests in the engine and the loop goes on; only
        ``MAX_FAILED_STEPS`` failures in a row (a broken device, say) end it."""
        failures = 0
        stats = self.step_stats = StepStats()
        while True:
            for kind, payload in drain_inbox(inbox, block=not self.busy()):
                if kind == "stop":
                    return
                if kind == "add":
                    self.add(*payload)
                elif kind == "abort":
                    self.abort(payload)
            if not self.busy():
                continue
            try:
                started = time.monotonic()
                counts = stats.decode_steps, stats.prefill_steps
                self._publish(self.step())
                now = time.monotonic()
                stats.add_time(counts, now - started)
                failures = 0
                if not self.busy():
                    self.publish([], self.stats())   # front ends see the engine idle
                if now - stats.since >= STATS_LOG_INTERVAL_S:
                    log.info("%s", stats.line(now, len(self.scheduler.running), len(self.scheduler.waiting),
                                              self.blocks.num_used / self.blocks.num_blocks))
                    stats.reset(now)
            except Exception as exc:
                failures += 1
                log.exception("engine step failed (%d in a row)", failures)
                self.runner.pipeline.drop()
                self.fail_all(f"{type(exc).__name__}: {exc}")
                if failures >= MAX_FAILED_STEPS:
                    raise

    def busy(self) -> bool:
        return self.scheduler.has_work() or self.runner.pipeline.busy or bool(self.compiling)

    def run_until_idle(self) -> None:
        """Steps until every request has finished (offline use: benchmarks, batch jobs)."""
        while self.busy():
            self._publish(self.step())

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, seed: int,
            follows: str | None = None) -> None:
        """``follows``: the id of another choice of the same prompt, sent just before; this one
        draws its first token from that one's prefill logits, then shares its full blocks (the
        prompt is computed once for all choices, but for the tokens past its last full block,
        which each computes with its first token in one more prefill). A request with a grammar
        waits for its compile instead, and is prefilled on its own."""
        seq = Sequence(request_id, prompt_ids, params, seed)
        if params.penalised:
            try:
                seq.penalty_row = self.runner.penalties.acquire(params.presence_penalty, params.frequency_penalty,
                                                                params.logit_bias)
            except ValueError as exc:
                self._publish([(request_id, self._finish(seq, "error", str(exc)))])
                return
        if params.grammar is not None:
            self.compiling[seq] = self.grammars.compile(params.grammar)
            return
        leader = None
        if follows is not None:
            leader = next((s for s in self.scheduler.waiting if s.request_id == follows), None)
        if leader is not None and leader.prompt_ids == seq.prompt_ids:
            leader.followers.append(seq)
        else:
            self.scheduler.add(seq)

    def _admit_compiled(self) -> list[tuple[str, object]]:
        """Requests whose grammar is compiled go to the scheduler; those whose grammar failed, end.
        With nothing else to do, waits a little for a compile first."""
        if not self.scheduler.has_work() and not self.runner.pipeline.busy:
            wait_futures(self.compiling.values(), timeout=COMPILE_POLL_S, return_when=FIRST_COMPLETED)
        events = []
        for seq, future in [(s, f) for s, f in self.compiling.items() if f.done()]:
            del self.compiling[seq]
            try:
                seq.matcher = new_matcher(future.result())
            except Exception as exc:
                events.append((seq.request_id, self._finish(seq, "error", str(exc))))
                continue
            self.constrained += 1
            self.scheduler.add(seq)
        return events

    def _held(self) -> list[Sequence]:
        """Choices waiting for another choice's prefill (not yet in the scheduler)."""
        return [f for s in self.scheduler.waiting for f in s.followers]

    def _release_followers(self, seq: Sequence) -> None:
        if seq.followers:
            self.scheduler.add_next(seq.followers)
            seq.followers = []

    def abort(self, request_id: str) -> None:
        for seq in itertools.chain(self.scheduler.running, self.scheduler.waiting, self._held(), list(self.compiling)):
            if seq.request_id == request_id:
                self._publish([(request_id, self._finish(seq, "abort"))])
                return

    def _publish(self, events) -> None:
        if events:
            self.publish(events, self.stats())

    def _mark_scheduled(self, seq: Sequence) -> None:
        if seq.first_scheduled is None:
            seq.first_scheduled = time.monotonic()

    @torch.inference_mode()
    def step(self) -> list[tuple[str, object]]:
        """One model step; returns the (request id, event) pairs that became known.

        A decode step is launched before the previous decode's tokens are read back (the model
        runner's ``pipeline``), so the host's bookkeeping overlaps the device's next step. So is
        a prefill: it is planned and launched while the decode in flight runs, and that decode's
        tokens are read back after it (no waiting sequence has a token in flight: a sequence
        preempted by a decode step has its last token read back by that step's launch). Batches
        that need every earlier token on the host first wait for the step in flight."""
        events = self._admit_compiled() if self.compiling else []
        if self.scheduler.needs_sync():
            events += self._emit(self.runner.pipeline.drain())
        work = self.scheduler.schedule()
        if work is None:
            return events + self._emit(self.runner.pipeline.drain())
        self.steps += 1
        if isinstance(work, PrefillStep):
            events += self._prefill(work)
            return events + self._emit(self.runner.pipeline.drain())
        self.step_stats.decode_steps += 1
        self.step_stats.generated += len(work.seqs)
        constrain = None
        if self.constrained and any(seq.matcher is not None for seq in work.seqs):
            def constrain(previous: Sampled | None):
                """This step's mask, filled while the device runs the step's forward: the previous
                step's tokens advance the matchers, the fill starts, and the rest of their
                bookkeeping runs beside it."""
                verdicts = self._advance_matchers(previous)
                pending = self.runner.token_masks.start_fill(work.seqs)
                events.extend(self._emit(previous, verdicts))
                return pending.result() if pending is not None else None
        sampled = self.runner.decode_step(work.seqs, self._sampling_rows(work.seqs), constrain)
        return events + self._emit(sampled)

    def _prefill(self, work: PrefillStep) -> list:
        self.step_stats.prefill_steps += 1
        self.step_stats.prompt_tokens += sum(take for _, take in work.chunks)
        for seq, _ in work.chunks:
            self._mark_scheduled(seq)
        ready = [i for i, (seq, take) in enumerate(work.chunks) if take == seq.prefill_remaining]
        # the other choices of a prompt draw their first token from its logits too, then wait
        # for a prefill of their tail (past the shared full blocks) and that token; as many as
        # the step's read-back has rows for (max_batch), the rest draw from their own prefill
        rows, takers = list(ready), [work.chunks[i][0] for i in ready]
        room = self.scheduler.max_batch - len(ready)
        for i in ready:
            followers = work.chunks[i][0].followers[:room]
            room -= len(followers)
            rows += [i] * len(followers)
            takers += followers
        sampled = self.runner.prefill_step(work.chunks, rows, self._sampling_rows(takers), takers)
        for seq, take in work.chunks:
            seq.num_cached += take
            self.blocks.commit(seq)
        bs = self.blocks.block_size
        for i in ready:
            leader = work.chunks[i][0]
            self.scheduler.prefill_done(leader)
            for follower in leader.followers:      # the leader's full blocks, which it holds
                follower.cached_tokens = len(leader.prompt_ids) // bs * bs if self.blocks.prefix_caching else 0
            self._release_followers(leader)
        return self._emit(sampled)

    def _sampling_rows(self, seqs) -> SamplingRows:
        return SamplingRows(
            temperature=[s.params.temperature for s in seqs],
            top_k=[s.params.top_k for s in seqs],
            top_p=[s.params.top_p for s in seqs],
            repetition_penalty=[s.params.repetition_penalty for s in seqs],
            seeds=[s.seed for s in seqs],
            positions=[len(s.output_ids) + s.pending for s in seqs],
            history=[s.token_ids if s.params.repetition_penalty != 1.0 else [] for s in seqs],
            logprobs=[s.params.logprobs_asked for s in seqs] if any(s.params.logprobs for s in seqs) else None,
            penalty_rows=([s.penalty_row for s in seqs] if any(s.penalty_row >= 0 for s in seqs) else None),
        )

    @staticmethod
    def _advance_matchers(sampled: Sampled | None) -> list[str | None] | None:
        """The read-back tokens given to their sequences' grammar matchers. Per sequence: None
        (no matcher, or ended), "rejected", "complete" (nothing more may follow) or "open"; read
        here, before a fill starts, so nothing else touches the matchers while it runs."""
        if sampled is None:
            return None
        verdicts = []
        for seq, token in zip(sampled.seqs, sampled.ids):
            matcher = seq.matcher
            if matcher is None or seq.is_finished:
                verdicts.append(None)
            elif not matcher.accept_token(token):
                verdicts.append("rejected")
            else:
                verdicts.append("complete" if matcher.is_terminated() else "open")
        return verdicts

    def _emit(self, sampled: Sampled | None, grammar: list[str | None] | None = None) -> list[tuple[str, object]]:
        """Apply read-back tokens; sequences that ended meanwhile (an abort, say) drop theirs.
        Events carry token ids only: the front end turns them into text (``output.py``).
        ``grammar``: ``_advance_matchers`` of ``sampled``, where it ran already."""
        if sampled is None:
            return []
        seqs, token_ids, token_logprobs, waited = sampled
        if grammar is None and self.constrained:
            grammar = self._advance_matchers(sampled)
        self.step_stats.device_wait_s += waited
        now = time.monotonic()
        events = []
        for i, seq in enumerate(seqs):
            if not seq.is_finished:
                self.sampled_tokens += 1
                logprobs = token_logprobs[i] if token_logprobs is not None else None
                events.extend(self._append_token(seq, token_ids[i], logprobs, now, grammar[i] if grammar else None))
        return events

    def _append_token(self, seq: Sequence, token: int, logprobs, now: float, grammar: str | None):
        seq.append(token)
        cached = None
        prompt_logprobs = None
        if seq.first_token is None:
            seq.first_token = now
            cached = seq.cached_tokens or 0
            prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None
        reason = None
        eos = token in self.eos_ids
        params = seq.params
        may_stop = len(seq.output_ids) > params.min_tokens
        if grammar == "rejected":
            return ((seq.request_id, self._finish(seq, "error", f"token {token} breaks the request's grammar")),)
        if eos and not params.ignore_eos and may_stop:
            reason = "eos"
        elif token in params.stop_token_ids and may_stop:
            reason = "stop"
        elif grammar == "complete":
            reason = "eos"                         # the grammar is complete: nothing more may follow
        elif len(seq.output_ids) >= params.max_new_tokens or seq.length >= self.max_model_len:
            reason = "length"
        # a stop token id prints nothing, as EOS does
        event = TokenEvent(token, "", None, eos or reason == "stop" or token in self.special_ids, now,
                           reason is not None, cached, None, prompt_logprobs)
        if logprobs is not None:
            event.logprob, best, best_values = logprobs
            k = params.top_logprobs
            if k:
                event.top_logprobs = list(zip(best[:k], best_values[:k]))
        if reason is None:
            return ((seq.request_id, event),)
        return (seq.request_id, event), (seq.request_id, self._finish(seq, reason))

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> FinishEvent:
        self._mark_scheduled(seq)
        self.compiling.pop(seq, None)
        if seq.matcher is not None and not seq.is_finished:
            self.constrained -= 1
        for leader in self.scheduler.waiting:
            if seq in leader.followers:
                leader.followers.remove(seq)
                break
        self.scheduler.remove(seq, keep_cache=reason != "error")
        self._release_followers(seq)
        if seq.penalty_row >= 0:
            self.runner.penalties.release(seq.penalty_row)
            seq.penalty_row = -1
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        now = time.monotonic()
        timings = {"queue": (seq.first_scheduled or now) - seq.arrival,
                   "ttft": (seq.first_token - seq.arrival) if seq.first_token else None,
                   "total": now - seq.arrival}
        return FinishEvent(reason, "", len(seq.prompt_ids), len(seq.output_ids), error, timings,
                           seq.cached_tokens or 0)

    def fail_all(self, message: str) -> None:
        seqs = list(itertools.chain(self.scheduler.running, self.scheduler.waiting, self._held(), self.compiling))
        self.compiling.clear()
        events = []
        for seq in seqs:
            try:
                events.append((seq.request_id, self._finish(seq, "error", message)))
            except Exception:
                log.exception("could not release %s", seq.request_id)
        self._publish(events)



def freeze_startup_heap() -> None:
    """For a process that serves until it exits, once its engine is built: moves every object
    alive now (model, tokenizer, libraries: hundreds of thousands) out of the garbage
    collector's sight. Without this each full collection, triggered every few dozen steps by the
    per-token events, walks all of them (measured: about 30 % of a B=256 step's host time).
    Objects frozen are never collected, so a process that builds and drops engines (tests)
    must not call it."""
    gc.collect()
    gc.freeze()


def drain_inbox(inbox, block: bool) -> list:
    """Every message waiting in ``inbox``, up to a stop (after which nothing is read: an inbox
    whose writers have all gone answers every read with one); with ``block``, the first may be
    waited for up to ``IDLE_POLL_S``."""
    messages = []
    try:
        messages.append(inbox.get(timeout=IDLE_POLL_S) if block else inbox.get_nowait())
        while messages[-1][0] != "stop":
            messages.append(inbox.get_nowait())
    except queue.Empty:
        pass
    return messages
