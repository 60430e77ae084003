"""A Llama-family model step on the CPU: the GGUF's own low-bit weights, few ops per layer.

Same contract as ``FusedDecoder`` and ``forward_logits``. The projections run either the
file's quantised weights (``models.quantized``: packed int4, bfloat16 activations) or the
model's dense float weights (in the model's dtype); where PyTorch runs its AVX2 kernels, a
quantised step of many rows (a prefill, a large batch) runs the float32 weights instead, which
are faster there (``float_rows_for``). The residual stream, norms, rotary
embedding and attention stay in the KV cache's dtype (float32 by default). Query and key
heads are kept in the interleaved-pair layout of the GGUF file (so the rotary embedding is one
complex multiply); dense rotate-half weights are permuted into it once. Attention scores are
dot products over the same permutation of query and key, so the model computed is the same.
"""

import logging
import os
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from kernels import reference_write_kv
from kernels.kv_quant import INT8

from .attention import AttentionBatch, head_dim_of, prefill_attention
from .cpu_attention import DecodePlan, split_kv_decode, write_new_kv
from .cpu_decode import compiled_decode_layer, mark_block_count, mark_sizes
from .cpu_threads import ALL_THREADS, ThreadChooser
from .fused_decoder import fuse_rows
from .quantized import ACT_DTYPE, DenseLinear, GgufTensor, Int4Linear, QuantizedEmbedding, linear_from_gguf, read_gguf

log = logging.getLogger(__name__)

CPU_WEIGHTS = ("auto", "quantized", "float")


def decode_parallel_bytes() -> int:
    """A decode step's matmuls with at least this many bytes of weights run on every intra-op
    thread, its other ops on one. Where idle OpenMP threads sleep (OMP_WAIT_POLICY=PASSIVE) each
    parallel region pays for waking them, more than a small op gains: only the LM head. Where
    they spin (ACTIVE, or OpenMP's default: a few ms), every matmul (docs/cpu.md, Threads)."""
    return 4 << 20 if os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE" else 0


# PyTorch's int4 matmul on its AVX2 kernels takes time almost in proportion to the rows: a float32
# matmul of the same weights is slower at 8 rows, faster from about 16 and 2.5x faster at 128
# (2 cores, AMD EPYC without AVX-512: docs/cpu.md, Hosts without AVX-512). Its AVX-512 kernels keep up with
# float32 at prefill's rows.
FLOAT_ROWS = 16


def float_rows_for(model) -> int | None:
    """The rows from which a quantised step of ``model`` runs its float32 weights on this CPU, or
    None (never; also where the model's weights are not float32)."""
    if model.dtype != torch.float32 or torch.backends.cpu.get_cpu_capability() != "AVX2":
        return None
    return FLOAT_ROWS


class FloatWeights(NamedTuple):
    """A quantised step's float32 projections, run by its steps of at least ``rows`` rows (the head
    by its own rows): each layer's (qkv, o, gate_up, down), and the LM head."""
    rows: int
    projections: list
    head: object


def interleave_rows(num_heads: int, head_dim: int) -> np.ndarray:
    """Row order taking rotate-half heads (pairs i, i + D/2) to interleaved ones (2i, 2i + 1)."""
    return np.arange(num_heads * head_dim).reshape(num_heads, 2, head_dim // 2).transpose(0, 2, 1).reshape(-1)


class CpuLlama:
    def __init__(self, model, layers, embed, head, final_norm: torch.Tensor, max_positions: int, describe: str,
                 float_weights: FloatWeights | None = None):
        cfg = model.config
        self.num_q_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = head_dim_of(cfg)
        self.hidden = cfg.hidden_size
        self.scale = model.model.layers[0].self_attn.scaling
        self.eps = cfg.rms_norm_eps
        self.embed, self.head = embed, head
        norm = lambda w: _RmsNorm(w, self.eps)
        self.layers = [(norm(n_in), qkv, o, norm(n_post), gate_up, down) for n_in, qkv, o, n_post, gate_up, down in layers]
        self.final_norm = norm(final_norm)
        self.float_rows = self.float_layers = self.float_head = None
        if float_weights is not None:
            self.float_rows, self.float_head = float_weights.rows, float_weights.head
            self.float_layers = [(n_in, qkv, o, n_post, gate_up, down) for (n_in, _, _, n_post, _, _), (qkv, o, gate_up, down)
                                 in zip(self.layers, float_weights.projections)]
        self.describe = describe
        positions = torch.arange(max_positions).unsqueeze(0)
        cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
        half = self.head_dim // 2
        cos, sin = cos[0, :, :half].float(), sin[0, :, :half].float()
        self.rotary = torch.complex(cos, sin)                  # [max_positions, D/2]
        self.cos, self.sin = cos, sin
        # a decode step folds the attention scale into the query heads' rotation (exact for D = 64)
        self.qk_scale = torch.tensor([self.scale] * self.num_q_heads + [1.0] * self.num_kv_heads).view(-1, 1)
        self.parallel_bytes = decode_parallel_bytes()
        self.threads = ThreadChooser(torch.get_num_threads())
        # A one-sequence decode step runs compiled layers (models.cpu_decode) where every projection
        # is int4, in either thread mode (compiled for the all-threads count, run on one in the
        # one-thread mode). warm_up() compiles them, or turns them off where compiling fails.
        self.compiled = all(isinstance(lin, Int4Linear) for layer in self.layers for lin in layer[1:3] + layer[4:])
        self.compiled_threads = self._layer_threads(ALL_THREADS)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                 logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        threads = self.threads.threads
        if threads == 1 or not batch.is_decode:
            self.threads.apply()                          # a prefill runs on the threads decode steps chose
            if batch.is_decode and self._runs_compiled(input_ids, batch):
                return self._decode_one(input_ids, positions, batch, logits_rows, _call, 1)
            return self._forward(input_ids, positions, batch, logits_rows, _call)
        # A decode step's ops are small: each parallel region costs more (waking the pool's idle
        # threads) than it saves, except in the larger matmuls (docs/cpu.md, Threads).
        def matmul(linear, x):
            if linear.nbytes < self.parallel_bytes:
                return linear(x)
            torch.set_num_threads(threads)
            y = linear(x)
            torch.set_num_threads(1)
            return y
        mode = self.threads.choose(input_ids.numel())
        started = time.perf_counter()
        torch.set_num_threads(1)
        try:
            # The compiled layers run in either mode: their parallel loops split independent outputs
            # only, so they compute the same on one thread as on all, while eager layers do not
            # compute what they do (the same request's tokens changed with the mode: docs/cpu.md).
            if self._runs_compiled(input_ids, batch):
                logits = self._decode_one(input_ids, positions, batch, logits_rows,
                                          matmul if mode == ALL_THREADS else _call, self._layer_threads(mode))
            else:
                logits = self._forward(input_ids, positions, batch, logits_rows,
                                       matmul if mode == ALL_THREADS else _call)
            self.threads.record(mode, input_ids.numel(), time.perf_counter() - started)
        finally:
            self.threads.apply()
        return logits

    def _layer_threads(self, mode: str) -> int:
        """Threads for a compiled layer: its few large parallel regions take every thread where idle
        ones spin (OpenMP's default wait), one where they sleep (PASSIVE) or in one-thread mode."""
        return self.threads.threads if mode == ALL_THREADS and self.parallel_bytes == 0 else 1

    def _runs_compiled(self, input_ids, batch: AttentionBatch) -> bool:
        return (self.compiled and batch.is_decode and input_ids.numel() == 1 and batch.kv_scales is None
                and batch.kv_caches[0][0].dtype == torch.float32 and int(batch.seq_lens[0]) > 1)

    def _decode_one(self, input_ids, positions, batch: AttentionBatch, logits_rows, matmul,
                    layer_threads: int) -> torch.Tensor:
        """A decode step of one sequence through ``compiled_decode_layer``."""
        block_size = batch.kv_caches[0][0].shape[2]
        cached = int(batch.seq_lens[0]) - 1
        block_ids = batch.block_tables[0, :-(-cached // block_size)].long()
        mark_block_count(block_ids)
        cached_tokens = torch.tensor(cached)
        block, row = divmod(int(batch.slot_mapping[0]), block_size)
        position = int(positions.reshape(-1)[0])
        cos, sin = self.cos[position], self.sin[position]
        residual = self.embed(input_ids.reshape(-1)).float()
        layer = compiled_decode_layer()
        torch.set_num_threads(layer_threads)
        for (norm_in, qkv, o_proj, norm_post, gate_up, down), (k_cache, v_cache) in zip(self.layers, batch.kv_caches):
            residual, key, value = layer(
                residual, norm_in.scaled, norm_in.hidden_eps, qkv.parts, cos, sin, self.qk_scale, k_cache, v_cache,
                block_ids, cached_tokens, o_proj.parts, norm_post.scaled, norm_post.hidden_eps, gate_up.parts,
                down.parts, self.num_q_heads)
            k_cache[block, :, row].copy_(key)
            v_cache[block, :, row].copy_(value)
        torch.set_num_threads(1)
        if logits_rows is not None:
            residual = residual[logits_rows]
        return matmul(self.head, self.final_norm(residual, self.head.act_dtype)).float()

    def warm_up(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> float | None:
        """Compiles the one-sequence decode layers on ``kv_caches`` (the engine's, before any request:
        it writes into their first blocks), so that no request waits for it. Seconds taken, or None
        where the step has no compiled layers or compiling failed (logged; it then runs eagerly)."""
        if not self.compiled:
            return None
        started = time.perf_counter()
        mark_sizes(kv_caches)
        position = torch.tensor([[1]], dtype=torch.int32)
        batch = AttentionBatch(kv_caches, position.view(-1), torch.zeros(1, 1, dtype=torch.int32),
                               torch.tensor([2], dtype=torch.int32), is_decode=True)
        try:
            with torch.inference_mode():
                self._decode_one(torch.zeros(1, 1, dtype=torch.int32), position, batch, None, _call,
                                 self.compiled_threads)
        except Exception as e:                                   # inductor needs a C++ compiler
            log.warning("CPU decode step: torch.compile failed (%s: %s); its layers run eagerly", type(e).__name__, e)
            self.compiled = False
            return None
        finally:
            self.threads.apply()
        return time.perf_counter() - started

    def _forward(self, input_ids, positions, batch: AttentionBatch, logits_rows, matmul) -> torch.Tensor:
        ids, positions = input_ids.reshape(-1), positions.reshape(-1)
        tokens = ids.shape[0]
        hq, hkv, d = self.num_q_heads, self.num_kv_heads, self.head_dim
        kv_dtype = batch.kv_caches[0][0].dtype
        if kv_dtype == INT8:
            kv_dtype = torch.float32            # int8 caches: the step computes in float32
        rotary = self.rotary[positions.long()].unsqueeze(1)                     # [T, 1, D/2]
        plan = None
        if batch.is_decode:
            plan = DecodePlan.make(batch.block_tables, batch.seq_lens, batch.slot_mapping,
                                   batch.kv_caches[0][0].shape[2])
            rotary = rotary * self.qk_scale                                     # q pre-scaled: [T, Hq + Hkv, D/2]
        residual = self.embed(ids).to(kv_dtype)
        for i, (norm_in, qkv_proj, o_proj, norm_post, gate_up_proj, down_proj) in enumerate(
                self.float_layers if self._on_float(tokens) else self.layers):
            k_cache, v_cache = batch.kv_caches[i]
            k_scale, v_scale = batch.layer_scales(i)
            qkv = matmul(qkv_proj, norm_in(residual, qkv_proj.act_dtype))
            qk = torch.view_as_complex(qkv[:, :(hq + hkv) * d].float().view(tokens, hq + hkv, d // 2, 2))
            qk = torch.view_as_real(qk * rotary).view(tokens, hq + hkv, d)
            q, k = qk[:, :hq], qk[:, hq:]
            v = qkv[:, (hq + hkv) * d:].view(tokens, hkv, d)
            if plan is not None:
                write_new_kv(k_cache, v_cache, k, v, plan, k_scale, v_scale)
                attn = split_kv_decode(q, k_cache, v_cache, plan, 1.0, k_scale, v_scale)
            else:
                reference_write_kv(k_cache, v_cache, k, v, batch.slot_mapping, k_scale, v_scale)
                attn = prefill_attention(q.to(kv_dtype), k.to(kv_dtype), v.to(kv_dtype), self.scale, batch,
                                         k_cache, v_cache, k_scale, v_scale)
            residual = _add(residual, matmul(o_proj, attn.reshape(tokens, hq * d).to(o_proj.act_dtype)))
            gate_up = matmul(gate_up_proj, norm_post(residual, gate_up_proj.act_dtype))
            half = gate_up.shape[-1] // 2
            residual = _add(residual, matmul(down_proj, F.silu(gate_up[:, :half]).mul_(gate_up[:, half:])))
        if logits_rows is not None:
            residual = residual[logits_rows]
        head = self.float_head if self._on_float(residual.shape[0]) else self.head
        return matmul(head, self.final_norm(residual, head.act_dtype)).float()

    def _on_float(self, rows: int) -> bool:
        """Whether projections over ``rows`` rows run the float32 weights."""
        return self.float_rows is not None and rows >= self.float_rows


class _RmsNorm:
    """``rms_norm(x) * weight`` in a given dtype. One float32 row (a B=1 decode step) runs as
    x * rsqrt(x . x + H eps) * (w sqrt(H)): an addmm and three element-wise ops instead of
    rms_norm's reductions and a cast (docs/log.md, CPU op trimming)."""

    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight, self.eps = weight, eps
        hidden = weight.shape[0]
        self.scaled = weight.float() * float(hidden) ** 0.5
        self.hidden_eps = torch.full((1, 1), eps * hidden)

    def __call__(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if x.shape[0] != 1 or x.dtype != torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps).to(dtype)
        s = torch.addmm(self.hidden_eps, x, x.t()).rsqrt_()                     # [1, 1]
        return torch.mul(x * s, self.scaled, out=torch.empty(x.shape, dtype=dtype))


def _add(residual: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``residual + y``, in place where that is the same dtype (the residual is this step's own)."""
    if torch.promote_types(residual.dtype, y.dtype) == residual.dtype:
        return residual.add_(y)
    return residual + y


def _call(linear, x):
    return linear(x)


def _act_dtype(linear, dtype):
    linear.act_dtype = dtype
    return linear


def _concat_rows(tensors: list[GgufTensor]) -> GgufTensor | None:
    first = tensors[0]
    if any(t.qtype != first.qtype or t.shape[1:] != first.shape[1:] for t in tensors):
        return None
    data = np.concatenate([np.asarray(t.data).reshape(t.shape[0], -1) for t in tensors])
    return GgufTensor("+".join(t.name for t in tensors), first.qtype, (data.shape[0], *first.shape[1:]), data)


class _Rows:
    """Projections whose outputs are concatenated (the q/k/v or gate/up of a layer)."""

    def __init__(self, parts):
        self.parts = parts
        self.act_dtype = parts[0].act_dtype
        self.nbytes = sum(p.nbytes for p in parts)
        self.out_features, self.in_features = sum(p.out_features for p in parts), parts[0].in_features

    def __call__(self, x):
        return torch.cat([p(x) for p in self.parts], dim=-1)


def _fused_linear(tensors: list[GgufTensor]):
    joined = _concat_rows(tensors)
    if joined is not None:
        return _act_dtype(linear_from_gguf(joined), ACT_DTYPE)
    return _Rows([_act_dtype(linear_from_gguf(t), ACT_DTYPE) for t in tensors])


def gguf_unsupported_reason(model, tensors: dict[str, GgufTensor], arch: str) -> str | None:
    cfg = model.config
    if arch != "llama" or cfg.model_type != "llama":
        return f"architecture {arch!r} / model_type {cfg.model_type!r} is not llama"
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False) or cfg.hidden_act != "silu":
        return "projections with bias or an activation other than silu"
    if f"blk.{cfg.num_hidden_layers - 1}.attn_q.weight" not in tensors:
        return "the file's layers do not match the model's config"
    return None


def from_gguf(model, path: Path, max_positions: int, float_rows: int | None = None) -> CpuLlama:
    """The model step on the file's own quantised weights; steps of at least ``float_rows`` rows
    on the model's float32 weights (None: none)."""
    arch, tensors = read_gguf(path)
    reason = gguf_unsupported_reason(model, tensors, arch)
    if reason is not None:
        raise ValueError(f"cannot run {path.name} quantised: {reason}")
    cfg = model.config
    f32 = lambda name: torch.from_numpy(tensors[name].dequantize().copy())
    layers = []
    for i in range(cfg.num_hidden_layers):
        t = lambda n: tensors[f"blk.{i}.{n}.weight"]
        layers.append((f32(f"blk.{i}.attn_norm.weight"),
                       _fused_linear([t("attn_q"), t("attn_k"), t("attn_v")]),
                       _act_dtype(linear_from_gguf(t("attn_output")), ACT_DTYPE),
                       f32(f"blk.{i}.ffn_norm.weight"),
                       _fused_linear([t("ffn_gate"), t("ffn_up")]),
                       _act_dtype(linear_from_gguf(t("ffn_down")), ACT_DTYPE)))
    table = tensors["token_embd.weight"]
    embed = QuantizedEmbedding(table) if QuantizedEmbedding.supports(table) else \
        (lambda w: (lambda ids: F.embedding(ids, w)))(torch.from_numpy(table.dequantize()))
    head = _act_dtype(linear_from_gguf(tensors.get("output.weight", table)), ACT_DTYPE)
    all_linears = [p for layer in layers for p in (layer[1], layer[2], layer[4], layer[5])] + [head]
    kinds = sorted({t.qtype.name for name, t in tensors.items() if name.endswith(".weight") and len(t.shape) == 2})
    dense = sum(1 for lin in _flatten(all_linears) if isinstance(lin, DenseLinear))
    nbytes = sum(lin.nbytes for lin in _flatten(all_linears))
    describe = (f"quantized from {path.name} ({', '.join(kinds)}; {nbytes / 1e6:.0f} MB of projection weights, "
                f"{dense} dense): int4 matmuls with bfloat16 activations")
    float_weights = None
    if float_rows is not None:
        if model.dtype != torch.float32:
            raise ValueError(f"float_rows needs the model's float32 weights, not {model.dtype}")
        float_weights = FloatWeights(float_rows, *_float_projections(model))
        describe += (f"; steps of {float_rows} rows or more on the float32 weights (faster on this CPU's "
                     f"{torch.backends.cpu.get_cpu_capability()} kernels: docs/cpu.md)")
    return CpuLlama(model, layers, embed, head, f32("output_norm.weight"), max_positions, describe,
                    float_weights)


def _flatten(linears):
    for lin in linears:
        yield from (lin.parts if isinstance(lin, _Rows) else [lin])


def _float_projections(model):
    """Each layer's (qkv, o, gate_up, down) and the LM head on the model's own weights (its dtype),
    query and key rows in the step's interleaved order."""
    cfg = model.config
    d = head_dim_of(cfg)
    q_rows = torch.from_numpy(interleave_rows(cfg.num_attention_heads, d))
    k_rows = torch.from_numpy(interleave_rows(cfg.num_key_value_heads, d))
    dense = lambda w: _act_dtype(DenseLinear(w.contiguous()), model.model.embed_tokens.weight.dtype)
    weight = lambda lin: lin.weight
    projections = []
    for layer in model.model.layers[:cfg.num_hidden_layers]:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = fuse_rows(weight, [attn.q_proj, attn.k_proj, attn.v_proj], [q_rows, k_rows, None])
        gate_up = fuse_rows(weight, [mlp.gate_proj, mlp.up_proj])
        projections.append((dense(qkv), dense(attn.o_proj.weight), dense(gate_up), dense(mlp.down_proj.weight)))
    return projections, dense(model.lm_head.weight)


def from_dense(model, max_positions: int) -> CpuLlama:
    """The model step on the model's own float weights (its dtype)."""
    core = model.model
    projections, head = _float_projections(model)
    layers = [(layer.input_layernorm.weight, qkv, o, layer.post_attention_layernorm.weight, gate_up, down)
              for layer, (qkv, o, gate_up, down) in zip(core.layers, projections)]
    dtype = core.embed_tokens.weight.dtype
    embed_weight = core.embed_tokens.weight
    describe = f"float ({dtype}, {sum(p.numel() for p in model.parameters()) * embed_weight.element_size() / 1e6:.0f} MB)"
    return CpuLlama(model, layers, lambda ids: F.embedding(ids, embed_weight), head, core.norm.weight,
                    max_positions, describe)


def unsupported_reason(model) -> str | None:
    """Why this step cannot run ``model`` (it runs Llama's layers only), or None when it can."""
    cfg = model.config
    if cfg.model_type != "llama":
        return f"model_type {cfg.model_type!r} is not llama"
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False) or cfg.hidden_act != "silu":
        return "projections with bias or an activation other than silu"
    return None


def cpu_forward(model, gguf_path: Path | None, mode: str, max_positions: int) -> CpuLlama:
    """The CPU model step for ``--cpu-weights mode``: 'quantized' needs a GGUF source the file's
    layout fits; 'auto' takes it where it does, else the float weights."""
    if mode not in CPU_WEIGHTS:
        raise ValueError(f"cpu_weights {mode!r} is not one of {', '.join(CPU_WEIGHTS)}")
    if mode == "float":
        return from_dense(model, max_positions)
    if gguf_path is None:
        if mode == "quantized":
            raise ValueError("cpu_weights 'quantized' needs a .gguf model (or the default); this model has no "
                             "quantised file")
        return from_dense(model, max_positions)
    try:
        return from_gguf(model, gguf_path, max_positions, float_rows_for(model))
    except ValueError as e:
        if mode == "quantized":
            raise
        log.info("CPU weights: %s; using the float weights", e)
        return from_dense(model, max_positions)
