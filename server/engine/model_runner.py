"""Runs model steps over the paged KV cache: prefill chunks, and decode steps replayed from
CUDA graphs captured per batch-size bucket.

A decode step's metadata goes to the device in one copy (``pipeline.py`` owns that protocol and
the read-back of the sampled ids); padded rows of a bucket carry slot -1 (they write nothing) and
length 1. A decode graph picks its rows' input ids, runs the model and takes the greedy ids, so a
step of greedy requests is a copy in, a replay and a copy out; other requests are sampled after
the replay. The KV pool, the split workspace and every static buffer are allocated once here.
"""

import functools
import logging
import time

import numpy as np
import torch

import kernels
from kernels import prefill_choice
from kernels.kv_quant import INT8, SCALE_DTYPE, new_scales
from models import (AttentionBatch, FusedDecoder, LoadedModel, cpu_forward, cpu_unsupported_reason, forward_logits,
                    fused_unsupported_reason, head_dim_of, layer_windows)

from .config import EngineConfig
from .grammar import TokenMasks
from .graphs import capture_graphs
from .penalties import PenaltyState, to_device
from .pipeline import Sampled, StepPipeline
from .prefill_graphs import PrefillGraphs, key_rows, token_slots
from .params import SamplingParams
from .sampler import SamplingRows, argmax_rows, clean_logits, prompt_logprobs, sample_clean
from .sequence import Sequence
from .threads import configure_cpu_threads

log = logging.getLogger(__name__)


def kv_row_bytes(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one cached row (a token's K or V for one KV head): its elements, plus an int8
    row's float16 scale."""
    scale = SCALE_DTYPE.itemsize if dtype == INT8 else 0
    return head_dim * dtype.itemsize + scale


def kv_bytes_per_block(config, block_size: int, dtype: torch.dtype) -> int:
    per_layer = 2 * config.num_key_value_heads * block_size * kv_row_bytes(head_dim_of(config), dtype)
    return per_layer * config.num_hidden_layers


def kv_cache_dtype(config: EngineConfig, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: int8 for 'int8', else the model's dtype."""
    return INT8 if config.kv_cache_dtype == "int8" else model_dtype


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, max_model_len: int):
        self.model = loaded.model
        self.gguf_path = loaded.gguf_path
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.kv_dtype = kv_cache_dtype(config, self.dtype)
        if self.kv_dtype == INT8 and self.device.type == "cuda" and self.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"kv_cache_dtype 'int8' on CUDA needs a bfloat16 or float16 model, not {self.dtype}")
        self.block_size = config.block_size
        self.max_batch = config.max_batch
        self.max_model_len = max_model_len
        cfg = self.model.config
        self.num_kv_heads = cfg.num_key_value_heads
        self.num_q_heads = cfg.num_attention_heads
        self.head_dim = head_dim_of(cfg)
        self.num_layers = cfg.num_hidden_layers
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)

        if self.device.type == "cpu":
            configure_cpu_threads()
        if self.device.type == "cuda":
            from kernels import ops
            ops.load(self.device)              # build before any capture traces the op
        self.workspace = kernels.Workspace(self.max_batch, self.num_q_heads, self.head_dim, max_model_len,
                                           self.device, num_kv_heads=self.num_kv_heads, windows=layer_windows(cfg),
                                           kv_int8=self.kv_dtype == INT8)
        # chunks after a cached prefix: the split-KV kernel where the measured table chose it (CUDA)
        self.prefill_choice = prefill_choice.PrefillChoice()
        self.prefill_workspace: kernels.PrefillWorkspace | None = None
        if self.device.type == "cuda":
            self._init_prefill_kernel(config)
        self.num_blocks = config.num_blocks or self._blocks_from_memory(config)
        shape = kernels.cache_shape(self.num_blocks, self.num_kv_heads, self.block_size, self.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                           torch.zeros(shape, dtype=self.kv_dtype, device=self.device))
                          for _ in range(self.num_layers)]
        self._init_decode_buffers()
        self.penalties = PenaltyState(cfg.vocab_size, self.device)
        self.forward = self._pick_forward(config)
        # int8: each layer's (k_scale, v_scale), the row scales beside the caches, written with the rows
        self.kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        if self.kv_dtype == INT8:
            self.kv_scales = [(new_scales(k), new_scales(v)) for k, v in self.kv_caches]
        if self.kv_dtype != self.dtype:
            log.info("KV pool: %d tokens in %d blocks of %d (%s)%s", self.kv_tokens, self.num_blocks, self.block_size,
                     self._describe_kv(), self._pool_comparison(config))
        # {batch bucket: (graph, (logits, greedy ids))}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.capture_seconds = 0.0
        self.prefill_graphs = None
        prefill_buckets = config.prefill_buckets(self.device.type == "cuda")
        if prefill_buckets:
            self.prefill_graphs = PrefillGraphs(self.forward, self.kv_caches, prefill_buckets,
                                                config.prefill_graph_max_seqs, self.block_size, self.device,
                                                self.kv_tokens, self.kv_scales)
        if self.device.type == "cuda" and config.cuda_graphs:
            self.capture(config.buckets())
            if self.prefill_graphs is not None:
                self.prefill_graphs.capture()

    def _init_prefill_kernel(self, config: EngineConfig) -> None:
        """Loads this GPU's measured choices for the model's head layout and cache dtype and, where
        any shape takes the split-KV kernel, allocates its workspace for the largest prefill step."""
        if any(w is not None for w in layer_windows(self.model.config)):
            log.info("prefill after a cached prefix: FlashAttention (the split-KV kernel's table measures no windows)")
            return
        device_name = torch.cuda.get_device_name(self.device)
        choice = prefill_choice.choice_for(device_name, self.num_q_heads, self.num_kv_heads, self.head_dim,
                                           self.kv_dtype)
        if not choice.ever_split_kv:
            log.info("prefill after a cached prefix: FlashAttention (%s has no measured shape where the split-KV "
                     "kernel wins for %s heads, %s cache)", device_name,
                     prefill_choice.layout_name(self.num_q_heads, self.num_kv_heads, self.head_dim), self.kv_dtype)
            return
        self.prefill_choice = choice
        self.prefill_workspace = kernels.PrefillWorkspace(config.max_prefill_tokens, self.num_q_heads, self.head_dim,
                                                          self.max_model_len, self.device,
                                                          num_kv_heads=self.num_kv_heads)
        log.info("prefill after a cached prefix: the split-KV kernel where %s measured it faster (%d of %d cases)",
                 device_name, sum(p == prefill_choice.SPLIT_KV for p in choice.cases.values()), len(choice.cases))

    def takes_split_kv(self, batch: int, total_rows: int, longest_cached: int, table_width: int) -> bool:
        """Whether an eager prefill step of chunks after a cached prefix runs the split-KV kernel."""
        workspace = self.prefill_workspace
        return (workspace is not None and total_rows <= workspace.max_rows and table_width <= self.max_blocks_per_seq
                and self.prefill_choice.split_kv(batch, total_rows, longest_cached))

    def _pick_forward(self, config: EngineConfig):
        reason = fused_unsupported_reason(self.model) if config.fused_layers else "turned off"
        if self.device.type == "cpu":
            cpu_reason = reason or cpu_unsupported_reason(self.model)
            if cpu_reason is None:
                step = cpu_forward(self.model, self.gguf_path, config.cpu_weights, self.max_model_len)
                log.info("CPU weights: %s", step.describe)
                log.info("CPU decode step: matmuls of at least %.0f MB of weights on every intra-op thread, "
                         "its other ops on one; all of it on one thread while that is faster (another process "
                         "on the cores)", step.parallel_bytes / 2 ** 20)
                seconds = step.warm_up(self.kv_caches) if self.kv_dtype == torch.float32 else None
                if seconds is not None:
                    log.info("CPU decode step of one sequence: its layers compiled (torch.compile) in %.1f s", seconds)
                return step
            if config.cpu_weights == "quantized":
                raise ValueError(f"cpu_weights 'quantized' needs a Llama-family model the CPU step runs: {cpu_reason}")
        elif config.cpu_weights == "quantized":
            raise ValueError(f"cpu_weights 'quantized' runs on the CPU, not on {self.device}")
        if reason is None:
            try:
                fused = FusedDecoder(self.model, self.max_model_len)
            except ValueError as e:
                reason = str(e)
            else:
                log.info("decoder layers run fused (%s)", fused.describe)
                return fused
        log.info("decoder layers run through transformers' modules (%s)", reason)
        return functools.partial(forward_logits, self.model)

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def _describe_kv(self) -> str:
        name = str(self.kv_dtype).replace("torch.", "")
        if self.kv_dtype == INT8:
            name += " with a float16 scale per token and KV head"
        return f"{name}, {kv_row_bytes(self.head_dim, self.kv_dtype)} bytes a row of {self.head_dim}"

    def _kv_budget(self, config: EngineConfig) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        in_use = total - free
        activation_reserve = 2 << 30
        return int(total * config.gpu_memory_fraction) - in_use - activation_reserve

    def _pool_comparison(self, config: EngineConfig) -> str:
        """The pool against one of the model's dtype in the same bytes (at the same memory
        fraction, where the pool is sized from memory)."""
        ratio = (kv_bytes_per_block(self.model.config, self.block_size, self.dtype)
                 / kv_bytes_per_block(self.model.config, self.block_size, self.kv_dtype))
        model_dtype = str(self.dtype).replace("torch.", "")
        if config.num_blocks or self.device.type != "cuda":
            return f"; {ratio:.2f}x the tokens of a {model_dtype} pool in the same bytes"
        same_bytes = self.num_blocks // ratio * self.block_size
        return (f"; {ratio:.2f}x the {int(same_bytes)} tokens of a {model_dtype} pool at gpu_memory_fraction "
                f"{config.gpu_memory_fraction}")

    def _blocks_from_memory(self, config: EngineConfig) -> int:
        per_block = kv_bytes_per_block(self.model.config, self.block_size, self.kv_dtype)
        if self.device.type != "cuda":
            return max(1, config.cpu_kv_cache_tokens // self.block_size)
        budget = self._kv_budget(config)
        if budget < per_block * self.max_blocks_per_seq:
            raise RuntimeError(f"gpu_memory_fraction {config.gpu_memory_fraction} leaves {budget >> 20} MiB "
                               f"for the KV pool, less than one {self.max_model_len}-token sequence")
        return budget // per_block

    # ---- decode inputs ---------------------------------------------------------------------

    def _init_decode_buffers(self):
        self.pipeline = StepPipeline(self.max_batch, self.max_blocks_per_seq, self.block_size, self.device)
        self.token_masks = TokenMasks(self.max_batch, self.model.get_output_embeddings().out_features, self.device)
        p = self.pipeline
        self.input_ids, self.positions, self.slots, self.seq_lens, self.block_tables = (
            p.input_ids, p.positions, p.slots, p.seq_lens, p.block_tables)

    def _decode_batch(self, rows: int) -> AttentionBatch:
        return AttentionBatch(self.kv_caches, self.slots[:rows], self.block_tables[:rows],
                              self.seq_lens[:rows], is_decode=True, workspace=self.workspace,
                              kv_scales=self.kv_scales)

    def _decode_forward(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step of the first ``rows`` rows loaded: their input ids picked, the forward,
        the greedy ids written to ``pipeline.sampled``. Returns the logits (``clean_logits``) and
        the greedy ids."""
        self.pipeline.select_inputs(rows)
        logits = clean_logits(self.forward(self.input_ids[:rows], self.positions[:rows], self._decode_batch(rows)))
        greedy = argmax_rows(logits)
        self.pipeline.sampled[:rows].copy_(greedy)
        return logits, greedy

    # ---- CUDA graphs ----------------------------------------------------------------------

    def bucket_for(self, batch: int) -> int | None:
        return min((b for b in self.graphs if b >= batch), default=None)

    def capture(self, buckets) -> None:
        started = time.monotonic()
        self.slots.fill_(-1)                               # capture writes nothing into the cache
        self.seq_lens.fill_(1)
        self.graphs = capture_graphs(self._decode_forward, buckets, self.device)
        self.capture_seconds = time.monotonic() - started
        log.info("captured decode graphs for batch sizes %s in %.1f s", sorted(self.graphs), self.capture_seconds)

    # ---- steps ----------------------------------------------------------------------------

    @torch.inference_mode()
    def decode_step(self, seqs, rows: SamplingRows, constrain=None) -> Sampled | None:
        """One decode step of ``seqs``, inputs taken from the step in flight where they are still on
        the device, sampled and sent to the host; returns the previous decode step's ids.

        ``constrain`` (structured output): called once the step is launched with the previous
        step's ids, read back early (None if there were none), it returns the token mask of
        ``seqs`` (``TokenMasks.fill``) or None: a greedy step's constrained rows then take their
        argmax among the allowed tokens, another step's logits are masked before sampling."""
        logits, greedy = self._decode(seqs, self.pipeline.sources(seqs))
        ids = logprobs = None
        mask = constrain(self.pipeline.take_inflight()) if constrain is not None else None
        greedy_only = rows.greedy_only
        if mask is not None and greedy_only:           # the constrained rows' ids redone in place
            self.token_masks.argmax_into(logits, mask, self.pipeline.sampled)
        elif mask is not None:
            self.token_masks.apply(logits, mask)
            greedy = self.token_masks.greedy_ids(logits, greedy, mask)   # the graph's saw the unmasked logits
        if not greedy_only:                            # else the step wrote its ids already
            ids, logprobs = sample_clean(logits, rows, greedy, self.penalties)
        for seq in seqs:
            seq.num_cached = seq.total_len
        return self.pipeline.launch(seqs, ids, logprobs)

    @torch.inference_mode()
    def prefill_step(self, chunks, ready: list[int], rows: SamplingRows, takers=None) -> Sampled | None:
        """Runs prompt chunks; samples the first token of the chunks at indices ``ready`` (those
        that complete their prompt), under their grammars' masks, and reads it back at once.
        ``takers``: the sequence each entry of ``ready`` samples for (default: the chunk's own; an
        index may repeat, for other choices of the same prompt). Sequences that ask for their
        prompt's log-probabilities get this chunk's added to ``seq.prompt_logprobs``."""
        wanting = [i for i, (seq, _) in enumerate(chunks) if seq.prompt_logprobs is not None]
        if wanting:
            logits, every_row = self._prefill_packed(chunks, every_row_of=wanting)
            for i, chunk_logits in zip(wanting, every_row):
                seq, take = chunks[i]
                seq.prompt_logprobs.extend(prompt_logprobs(chunk_logits, seq.prompt_ids, seq.num_cached,
                                                           seq.params.prompt_logprobs))
        else:
            logits = self.prefill(chunks)
        if not ready:
            return None
        if ready != list(range(len(chunks))):
            logits = logits[torch.tensor(ready, device=logits.device)]
        seqs = takers or [chunks[i][0] for i in ready]
        logits = clean_logits(logits)
        mask = self.token_masks.fill(seqs) if any(s.matcher is not None for s in seqs) else None
        if mask is not None:
            self.token_masks.apply(logits, mask)
        ids, logprobs = sample_clean(logits, rows, penalties=self.penalties)
        return self.pipeline.read_now(seqs, ids, logprobs)

    @torch.inference_mode()
    def decode(self, seqs, sources=None) -> torch.Tensor:
        """Logits [len(seqs), vocab] for the next token of each sequence, float32 with NaN read as
        -inf (see ``StepPipeline.load`` for ``sources``); a copy, since a graph's next replay
        overwrites its own."""
        return self._decode(seqs, sources)[0].clone()

    def _decode(self, seqs, sources=None) -> tuple[torch.Tensor, torch.Tensor]:
        batch = len(seqs)
        bucket = self.bucket_for(batch)
        self.pipeline.load(seqs, sources or [-1] * batch, bucket or batch)
        if bucket is None:
            return self._decode_forward(batch)
        graph, (logits, greedy) = self.graphs[bucket]
        graph.replay()
        return logits[:batch], greedy[:batch]

    @torch.inference_mode()
    def prefill(self, chunks) -> torch.Tensor:
        """Runs prompt chunks [(seq, n_tokens)]; returns logits of the last token of each chunk
        (the caller keeps only those of sequences whose prompt is now complete)."""
        graphs = self.prefill_graphs
        if graphs is not None:
            shape = graphs.bucket_for(chunks)
            if shape is not None:
                slots = np.concatenate([token_slots(seq, seq.num_cached, take, self.block_size)
                                        for seq, take in chunks])
                return graphs.run(chunks, slots, shape)
        return self._prefill_packed(chunks)

    def _prefill_packed(self, chunks, every_row_of: list[int] = ()):
        """The packed prefill of ``chunks``: logits of each chunk's last token; with
        ``every_row_of`` (chunk indices), also the logits of every token of those chunks, a list
        of [take, vocab] tensors, as a second value."""
        ids, positions, slots, starts, contexts = [], [], [], [0], []
        for seq, take in chunks:
            first = seq.num_cached
            tokens = seq.token_ids[first:first + take]
            ids.extend(tokens)
            positions.extend(range(first, first + take))
            slots.append(token_slots(seq, first, take, self.block_size))
            starts.append(starts[-1] + take)
            contexts.append(first)
        width = max(len(seq.block_table) for seq, _ in chunks)
        table = np.zeros((len(chunks), width), dtype=np.int32)
        lens = []
        for i, (seq, take) in enumerate(chunks):
            table[i, :len(seq.block_table)] = seq.block_table
            lens.append(seq.num_cached + take)
        to_dev = self._to_device
        on_gpu = self.device.type == "cuda"
        context = {}
        if any(contexts) and on_gpu and self.takes_split_kv(len(chunks), starts[-1], max(contexts), width):
            context = dict(prefill_workspace=self.prefill_workspace)
        elif any(contexts) and on_gpu:           # one varlen call over key rows read from the cache
            key_slots, key_starts = key_rows(chunks, self.block_size)
            context = dict(key_slots=to_dev(key_slots),
                           cu_kv_starts=to_dev(key_starts), kv_starts=key_starts,
                           max_kv_len=max(b - a for a, b in zip(key_starts, key_starts[1:])))
        batch = AttentionBatch(self.kv_caches, to_dev(np.concatenate(slots)), to_dev(table), to_dev(lens),
                               is_decode=False, workspace=self.workspace,
                               query_starts=starts, context_lens=contexts,
                               cu_query_starts=to_dev(starts) if on_gpu else None,
                               max_query_len=max(b - a for a, b in zip(starts, starts[1:])),
                               kv_scales=self.kv_scales, **context)
        last = [s - 1 for s in starts[1:]]
        if not every_row_of:
            return self.forward(to_dev(ids).unsqueeze(0), to_dev(positions).unsqueeze(0),
                                batch, logits_rows=to_dev(last))
        extra = [r for i in every_row_of for r in range(starts[i], starts[i + 1])]
        logits = self.forward(to_dev(ids).unsqueeze(0), to_dev(positions).unsqueeze(0),
                              batch, logits_rows=to_dev(last + extra))
        spans, at = [], len(last)
        for i in every_row_of:
            take = starts[i + 1] - starts[i]
            spans.append(logits[at:at + take])
            at += take
        return logits[:len(last)], spans

    def prefill_seconds(self, tokens: int, context: int) -> float:
        """Times a throwaway prefill chunk of ``tokens`` after ``context`` cached ones, written into
        the pool's first blocks: for an idle engine only (start-up)."""
        seq = Sequence("prefill-probe", [1] * (context + tokens), SamplingParams(), seed=0)
        seq.block_table = list(range(-(-(context + tokens) // self.block_size)))
        seq.num_cached = context
        started = time.perf_counter()
        self.prefill([(seq, tokens)])
        return time.perf_counter() - started

    def _to_device(self, values) -> torch.Tensor:
        return to_device(values, torch.int32, self.device)
