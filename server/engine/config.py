from dataclasses import dataclass

from kernels.paging import DEFAULT_BLOCK_SIZE


DEFAULT_PREFILL_BUCKETS = (128, 256, 512, 1024, 2048, 4096)
KV_CACHE_DTYPES = ("auto", "int8")       # auto: the model's dtype; int8: codes with a scale per token and KV head
# kv_cache_dtype values that were served once, and why they are not any more
REMOVED_KV_CACHE_DTYPES = {
    "fp8": "kv_cache_dtype 'fp8' (float8_e4m3fn with a scale per layer and KV head) was removed: on "
           "SmolLM2-135M it moved predictions 15x as far as the bf16 cache's own rounding (mean KL 1.9e-2 "
           "against 1.2e-3 nats); use 'int8' (a scale per token and KV head: the same bytes, within the "
           "bf16 cache's accuracy)",
}


@dataclass
class EngineConfig:
    block_size: int = DEFAULT_BLOCK_SIZE     # tokens per KV block
    num_blocks: int | None = None            # KV pool size; None sizes it from memory
    cpu_kv_cache_tokens: int = 32768         # pool size on the CPU when num_blocks is None
    gpu_memory_fraction: float = 0.8         # share of GPU memory for weights + KV pool + graphs
    max_batch: int = 256                     # sequences decoded in one step
    max_model_len: int | None = None         # None: the model's own context length
    max_prefill_tokens: int = 4096           # prompt tokens admitted per step (long prompts in chunks)
    # CPU: fewer prompt tokens per step where they would take longer than this many seconds, by
    # the prefill speed measured at start-up (prefill_budget.py); 0 turns that off
    cpu_prefill_step_s: float = 0.2
    prefill_delay_steps: int = 0             # decode steps arrivals may wait to be prefilled together
    # while streams decode, a prefill step may follow another at once if what waits has at most
    # this many tokens to compute (after cached prefixes); 0: a decode step always comes between
    chained_prefill_tokens: int = 1024
    max_waiting_requests: int = 1024         # queue bound: admission answers QueueFullError past it
    max_waiting_tokens: int = 4_000_000      # queue bound in prompt + max_new tokens
    cuda_graphs: bool = True
    prefix_caching: bool = True              # full KV blocks of earlier requests serve later ones
    fused_layers: bool = True                # models.FusedDecoder where it serves the model (else transformers' layers)
    cpu_weights: str = "auto"                # CPU: a GGUF's own quantised weights (auto, quantized) or float
    graph_buckets: tuple[int, ...] | None = None   # decode batch sizes captured; None: 1, 2, 4, ... max_batch
    # Whole prompts, up to prefill_graph_max_seqs of them and these many tokens in all, are
    # prefilled packed and padded to the next bucket, replayed from CUDA graphs on a GPU (eagerly
    # elsewhere, which only tests that path); () prefills every prompt eagerly, unpadded. None:
    # DEFAULT_PREFILL_BUCKETS with CUDA graphs on a GPU, () elsewhere. Buckets past
    # max_prefill_tokens are dropped.
    prefill_graph_buckets: tuple[int, ...] | None = None
    prefill_graph_max_seqs: int = 64
    kv_cache_dtype: str = "auto"             # KV_CACHE_DTYPES

    def __post_init__(self):
        if self.cpu_prefill_step_s < 0:
            raise ValueError(f"cpu_prefill_step_s {self.cpu_prefill_step_s} is negative (0 turns the time budget off)")
        if self.kv_cache_dtype in REMOVED_KV_CACHE_DTYPES:
            raise ValueError(REMOVED_KV_CACHE_DTYPES[self.kv_cache_dtype])
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")

    def prefill_buckets(self, on_gpu: bool) -> tuple[int, ...]:
        if self.prefill_graph_buckets is None:
            chosen = DEFAULT_PREFILL_BUCKETS if on_gpu and self.cuda_graphs else ()
        else:
            chosen = self.prefill_graph_buckets
        return tuple(sorted(b for b in chosen if b <= self.max_prefill_tokens))

    def buckets(self) -> tuple[int, ...]:
        if self.graph_buckets:
            return tuple(sorted(b for b in self.graph_buckets if b <= self.max_batch))
        sizes, b = [], 1
        while b < self.max_batch:
            sizes.append(b)
            b *= 2
        return tuple(sizes + [self.max_batch])
