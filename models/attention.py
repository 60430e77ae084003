"""Our attention, registered with transformers so that the model's own attention layers call it.

A forward pass that carries an ``AttentionBatch`` (through the model's keyword arguments) runs
on the paged KV cache: the new keys and values are written into the cache, then a prefill
attends causally over each prompt chunk and a decode step calls ``kernels.flash_decode``.
Without one, the function behaves like transformers' SDPA attention, so the same model object
still works with ``generate``.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

import kernels
from kernels.kv_quant import dequantize_rows

NAME = "paged_split_kv"   # transformers treats any name containing "flash" as FlashAttention


def head_dim_of(config) -> int:
    """A transformers config's attention head size."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_windows(config) -> list[int | None]:
    """Each layer's sliding window (None: global attention), as transformers' attention modules
    hand it to ours: ``sliding_window`` on the layers ``layer_types`` marks "sliding_attention"
    (Gemma 3, Qwen2 with use_sliding_window); without ``layer_types``, on every layer."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        return [window] * config.num_hidden_layers
    return [window if kind == "sliding_attention" else None for kind in types]


@dataclass
class AttentionBatch:
    """Everything attention needs for one forward pass over the paged cache.

    Decode: one new token per sequence; tokens are ``[B, 1]``. Prefill: the prompt chunks of
    several sequences packed as ``[1, T]``; ``query_starts`` (host ints, length n+1) delimit
    them and ``context_lens`` (host ints) count each sequence's tokens already in the cache.
    """
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    slot_mapping: torch.Tensor                   # [T] slot of every new token, -1 writes nothing
    block_tables: torch.Tensor                   # [B, max_blocks] int32
    seq_lens: torch.Tensor                       # [B] int32, tokens in cache after this pass
    is_decode: bool
    workspace: kernels.Workspace | None = None
    query_starts: list[int] | None = None
    context_lens: list[int] | None = None
    # query_starts on the device (int32, may end in empty sequences) and the longest chunk, for one
    # varlen attention call on a GPU: over the chunks' own keys for whole prompts (nothing cached
    # before them), else over the key rows read at key_slots.
    cu_query_starts: torch.Tensor | None = None
    max_query_len: int = 0
    # Chunks after a cached prefix, in one varlen call over keys and values read from the cache
    # (kernels.read_kv): the cache slot of every key row ([K] int32, each sequence's rows in
    # order, its cached tokens then its chunk; -1 reads zeros), the key rows' starts (int32 on the
    # device; host ints for the CPU) and the longest. The query rows attend causally, aligned to
    # the end of their key rows.
    key_slots: torch.Tensor | None = None
    cu_kv_starts: torch.Tensor | None = None
    kv_starts: list[int] | None = None
    max_kv_len: int = 0
    # int8 caches: each layer's (k_scale, v_scale), the row scales, float16 [num_blocks, Hkv,
    # block_size] on the caches' device (kernels.kv_quant)
    kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    # Set instead of key_slots where the measured table chose the split-KV kernel for this step
    # (kernels.prefill_choice): chunks after a cached prefix attend through kernels.flash_prefill
    # on the paged cache (block_tables, seq_lens, cu_query_starts) with this workspace.
    prefill_workspace: kernels.PrefillWorkspace | None = None

    def layer_scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(k_scale, v_scale)`` of layer ``layer``'s int8 caches; ``(None, None)`` for other caches."""
        return self.kv_scales[layer] if self.kv_scales is not None else (None, None)


# Prompt lengths change with every request: backends that plan per shape (cuDNN builds a graph
# for each new length) would pay that on every prefill.
PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def cached_rows(cache: torch.Tensor, row_scales: torch.Tensor | None, table: torch.Tensor, total: int,
                dtype: torch.dtype) -> torch.Tensor:
    """A sequence's first ``total`` rows of ``cache`` ``[1, Hkv, total, D]`` as ``dtype``: int8 codes
    dequantised at their row scales (``row_scales``, None for other caches)."""
    rows = kernels.reference.gather_dense(cache, table, total)
    if row_scales is None:
        return rows.to(dtype)
    scales = kernels.reference.gather_dense(row_scales.unsqueeze(-1), table, total).squeeze(-1)
    return dequantize_rows(rows, scales, dtype)


def prefill_attention(q, k, v, scale, batch: AttentionBatch, k_cache, v_cache, k_scale=None, v_scale=None, *,
                      window: int | None = None) -> torch.Tensor:
    """Causal attention of packed prompt chunks: ``q [T, Hq, D]``, ``k/v [T, Hkv, D]`` (their keys
    and values already in the cache); returns ``[T, Hq, D]``. Chunks after a cached prefix run the
    split-KV kernel where the batch carries a ``prefill_workspace``, else FlashAttention over key
    rows read from the cache (SDPA on a CPU). With a sliding ``window`` the query
    at position i attends to positions ``i - window < p <= i`` (``kernels.window``). Keys and
    values read back from int8 caches are dequantised at their row scales ``k_scale``/``v_scale``."""
    window = kernels.check_window(window)
    if batch.prefill_workspace is not None:
        return kernels.flash_prefill(q, k_cache, v_cache, batch.block_tables, batch.cu_query_starts, batch.seq_lens,
                                     scale=scale, window=window, k_scale=k_scale, v_scale=v_scale,
                                     workspace=batch.prefill_workspace)
    if batch.key_slots is not None:
        k, v = kernels.read_kv(k_cache, v_cache, batch.key_slots, q.dtype, k_scale, v_scale)    # [K, Hkv, D]
        if q.is_cuda:
            return torch.ops.aten._flash_attention_forward(
                q, k, v, batch.cu_query_starts, batch.cu_kv_starts, batch.max_query_len, batch.max_kv_len,
                0.0, True, False, scale=scale, **_flash_window(window))[0]
        return _gathered_chunks(q, k, v, scale, batch, window)
    if q.is_cuda and batch.cu_query_starts is not None:
        return _varlen_causal(q, k, v, scale, batch, window)
    out = q.new_zeros(q.shape)
    with sdpa_kernel(PREFILL_BACKENDS, set_priority=True):
        _prefill_chunks(out, q, k, v, scale, batch, k_cache, v_cache, window, k_scale, v_scale)
    return out


def _flash_window(window: int | None) -> dict:
    """FlashAttention's window arguments: the keys it sees left of the causal diagonal (none without one)."""
    return {} if window is None else {"window_size_left": window - 1, "window_size_right": 0}


def causal_mask(num_queries: int, num_keys: int, window: int | None, device=None):
    """The causal mask of ``num_queries`` queries at the end of ``num_keys`` keys (True: attend), or
    ``causal_lower_right`` where there is no window; with one, key p is seen by the query at
    position i when ``i - window < p <= i``."""
    if window is None:
        return causal_lower_right(num_queries, num_keys)
    query_pos = torch.arange(num_keys - num_queries, num_keys, device=device).view(-1, 1)
    key_pos = torch.arange(num_keys, device=device).view(1, -1)
    return (key_pos <= query_pos) & (key_pos > query_pos - window)


def _gathered_chunks(q, k, v, scale, batch: AttentionBatch, window=None) -> torch.Tensor:
    """The CPU's loop for ``key_slots``: per sequence, its queries against the key rows read for it."""
    out = q.new_zeros(q.shape)
    qs, ks = batch.query_starts, batch.kv_starts
    for i in range(len(qs) - 1):
        n, total = qs[i + 1] - qs[i], ks[i + 1] - ks[i]
        if n == 0:
            continue
        qi = q[qs[i]:qs[i + 1]].transpose(0, 1).unsqueeze(0)
        ki, vi = (t[ks[i]:ks[i + 1]].transpose(0, 1).unsqueeze(0) for t in (k, v))
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=causal_mask(n, total, window, q.device), scale=scale,
                                           enable_gqa=True)
        out[qs[i]:qs[i + 1]] = o[0].transpose(0, 1)
    return out


def _varlen_causal(q, k, v, scale, batch: AttentionBatch, window=None) -> torch.Tensor:
    """Whole prompts (nothing cached before them) in one FlashAttention varlen call: a loop of
    one SDPA call per prompt and layer costs ~65 us of host time each."""
    longest = batch.max_query_len
    return torch.ops.aten._flash_attention_forward(q, k, v, batch.cu_query_starts, batch.cu_query_starts,
                                                   longest, longest, 0.0, True, False, scale=scale,
                                                   **_flash_window(window))[0]


def _prefill_chunks(out, q, k, v, scale, batch: AttentionBatch, k_cache, v_cache, window=None, k_scale=None,
                    v_scale=None) -> None:
    for i, (start, end) in enumerate(zip(batch.query_starts, batch.query_starts[1:])):
        context = batch.context_lens[i]
        qi = q[start:end].transpose(0, 1).unsqueeze(0)                        # [1, Hq, n, D]
        if context == 0:
            ki, vi = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (k, v))
            if window is None or window >= end - start:
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
            else:
                mask = causal_mask(end - start, end - start, window, q.device)
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True)
        else:
            # A later chunk of a long prompt: its queries see the cached tokens before it, and
            # causally each other (the causal diagonal aligned to the bottom right).
            total = context + end - start
            # (enable_gqa, not repeated key heads: at 4k cached rows the copies cost 5x the attention)
            table = batch.block_tables[i:i + 1]
            ki = cached_rows(k_cache, k_scale, table, total, q.dtype)
            vi = cached_rows(v_cache, v_scale, table, total, q.dtype)
            mask = causal_mask(end - start, total, window, q.device)
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    attn_batch: AttentionBatch | None = None, **kwargs):
    if attn_batch is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, **kwargs)
    # transformers hands a sliding layer's window in (Gemma 3, Qwen2: ``sliding_window=``), None elsewhere.
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    k_cache, v_cache = attn_batch.kv_caches[module.layer_idx]
    k_scale, v_scale = attn_batch.layer_scales(module.layer_idx)
    # [B, H, T, D] -> [B*T, H, D]: one row per new token, the order of slot_mapping
    new_k = key.transpose(1, 2).flatten(0, 1)
    new_v = value.transpose(1, 2).flatten(0, 1)
    kernels.write_kv(k_cache, v_cache, new_k, new_v, attn_batch.slot_mapping, k_scale, v_scale)
    if attn_batch.is_decode:
        out = kernels.flash_decode(query[:, :, 0], k_cache, v_cache, attn_batch.block_tables,
                                   attn_batch.seq_lens, scale=scaling, workspace=attn_batch.workspace,
                                   window=window, k_scale=k_scale, v_scale=v_scale)
        return out.unsqueeze(1), None
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))     # [T, H, D]
    return prefill_attention(q, k, v, scaling, attn_batch, k_cache, v_cache, k_scale, v_scale,
                             window=window).unsqueeze(0), None


def register() -> None:
    AttentionInterface.register(NAME, paged_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
