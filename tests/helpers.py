"""Driving the engine synchronously from tests."""

import asyncio

from server.engine import Engine, FinishEvent, SamplingParams


def chat_ids(tokenizer, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


async def collect(engine: Engine, prompt_ids, params: SamplingParams, abort_after: int | None = None,
                  logprobs: list | None = None):
    """(tokens, text, finish event); each token's log-probability goes into ``logprobs`` if given."""
    stream = engine.add_request(list(prompt_ids), params)
    tokens, texts = [], []
    async for event in stream:
        if isinstance(event, FinishEvent):
            return tokens, "".join(texts), event
        tokens.append(event.token_id)
        texts.append(event.text)
        if logprobs is not None:
            logprobs.append(event.logprob)
        if abort_after is not None and len(tokens) == abort_after:
            stream.abort()


def run_all(engine: Engine, requests):
    """requests: [(prompt_ids, params)], [(prompt_ids, params, abort_after)] or
    [(prompt_ids, params, abort_after, logprobs list)], served together."""
    async def main():
        return await asyncio.gather(*(collect(engine, *r) for r in requests))
    return asyncio.run(main())


def tokens_under(loaded, configs, requests, with_logprobs: bool = False) -> list:
    """For each engine config in turn, the generated tokens of ``requests`` (as ``run_all``), or with
    ``with_logprobs`` their (tokens, log-probabilities) pairs."""
    results = []
    for config in configs:
        engine = Engine(loaded, config)
        engine.start()
        try:
            logprobs = [[] for _ in requests]
            done = run_all(engine, [(p, params, None, lp) for (p, params), lp in zip(requests, logprobs)])
            results.append([(tokens, lp) if with_logprobs else tokens for (tokens, _, _), lp in zip(done, logprobs)])
        finally:
            engine.shutdown()
    return results


def failing_on_second_call(fn):
    """``fn``, raising RuntimeError("injected") on its second call instead."""
    calls = {"n": 0}

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected")
        return fn(*args, **kwargs)
    return wrapped


def check_one_request_fails_then_the_engine_serves(engine) -> None:
    """With a failure injected into the engine's second step: that request ends in an error
    naming it, and the next request runs to its length."""
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    (_, _, failed), = run_all(engine, [([5, 6, 7], params)])
    assert failed.reason == "error" and "injected" in failed.error
    (tokens, _, ok), = run_all(engine, [([5, 6, 7], params)])
    assert ok.reason == "length" and len(tokens) == 6


def perturb_small_tensors(model, seed: int = 0, spread: float = 0.2) -> None:
    """Norm weights and biases set to random values: a random-weight model initialises them to
    constants (ones, zeros), under which a missing bias or a wrong norm offset goes unseen."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_((torch.randn(param.shape, generator=gen) * spread).to(param.dtype).to(param.device))


def runner_teacher_forced(runner, prompt: list[int], continuation: list[int]):
    """Logits of the prompt's last position from one prefill, then of each decode step fed
    ``continuation`` (its last token is not fed): ``[len(continuation), vocab]``."""
    from server.engine.block_manager import BlockManager
    from server.engine.sequence import Sequence

    blocks = BlockManager(runner.num_blocks, runner.block_size)
    seq = Sequence("tf", prompt, SamplingParams(), seed=0)
    blocks.grow(seq.block_table, seq.length)
    return decode_continuation(runner, blocks, seq, runner.prefill([(seq, seq.length)])[0], continuation)


def decode_continuation(runner, blocks, seq, first_logits, continuation):
    """``first_logits`` (of the prefill's last position), then the logits of each decode step fed
    ``continuation`` (its last token is not fed)."""
    import torch

    rows = [first_logits.float()]
    seq.num_cached = seq.length
    for token in continuation[:-1]:
        seq.append(token)
        blocks.grow(seq.block_table, seq.length)
        rows.append(runner.decode([seq])[0].float())
        seq.num_cached = seq.length
    return torch.stack(rows)


def runner_greedy(runner, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy decoding through the runner's own prefill and decode steps."""
    from server.engine.block_manager import BlockManager
    from server.engine.sequence import Sequence

    blocks = BlockManager(runner.num_blocks, runner.block_size)
    seq = Sequence("greedy", prompt, SamplingParams(), seed=0)
    blocks.grow(seq.block_table, seq.length)
    logits = runner.prefill([(seq, seq.length)])[0]
    out = []
    while True:
        out.append(int(logits.argmax()))
        if len(out) == new_tokens:
            return out
        seq.num_cached = seq.length
        seq.append(out[-1])
        blocks.grow(seq.block_table, seq.length)
        logits = runner.decode([seq])[0]
