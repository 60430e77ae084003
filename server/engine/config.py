from dataclasses import dataclass


@dataclass
class EngineConfig:
    block_size: int = 32
    num_blocks: int | None = None            # KV pool size; None sizes it from memory
    cpu_kv_cache_tokens: int = 32768         # pool size on the CPU when num_blocks is None
    gpu_memory_fraction: float = 0.8         # share of GPU memory for weights + KV pool + graphs
    max_batch: int = 256                     # sequences decoded in one step
    max_model_len: int | None = None         # None: the model's own context length
    max_prefill_tokens: int = 4096           # prompt tokens admitted per step (long prompts in chunks)
    prefill_delay_steps: int = 8             # decode steps arrivals may wait to be prefilled together
    max_waiting_requests: int = 1024         # queue bound: admission answers QueueFullError past it
    max_waiting_tokens: int = 4_000_000      # queue bound in prompt + max_new tokens
    cuda_graphs: bool = True
    fused_layers: bool = True                # Llama models run models.FusedLlama (else transformers' layers)
    compile: bool = False                    # torch.compile the decode step before graph capture
    graph_buckets: tuple[int, ...] | None = None   # decode batch sizes captured; None: 1, 2, 4, ... max_batch
    # Whole prompts up to these lengths are prefilled one sequence at a time, padded to the next
    # length and (on a GPU) replayed from CUDA graphs; () prefills every prompt eagerly, packed.
    prefill_graph_buckets: tuple[int, ...] = ()

    def buckets(self) -> tuple[int, ...]:
        if self.graph_buckets:
            return tuple(sorted(b for b in self.graph_buckets if b <= self.max_batch))
        sizes, b = [], 1
        while b < self.max_batch:
            sizes.append(b)
            b *= 2
        return tuple(sizes + [self.max_batch])
