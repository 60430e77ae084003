"""The fp8 KV cache's scales: one float32 per layer and KV head for K and one for V, calibrated at
start-up from a prefill of a short text the project ships (``models/calibration.txt``), or read
from a JSON file.

Calibration prefills the text into a scratch cache of the model's dtype and takes each layer's
and head's largest |K| and |V|; the scale maps CALIBRATION_HEADROOM times that to 448, e4m3's
largest code, so that a later token up to that much larger is not clipped (an e4m3 code keeps
three mantissa bits at any magnitude down to 2^-6 of its largest, so headroom costs little).
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch

import kernels
from kernels.kv_quant import scales_from_amax
from models import AttentionBatch

CALIBRATION_TEXT = Path(__file__).resolve().parents[2] / "models" / "calibration.txt"
CALIBRATION_HEADROOM = 2.0


@dataclass
class KvScales:
    k: torch.Tensor          # [num_layers, num_kv_heads] float32
    v: torch.Tensor
    source: str              # where they came from, for the start-up log

    def describe(self) -> str:
        return (f"K {self.k.min().item():.3g}..{self.k.max().item():.3g}, "
                f"V {self.v.min().item():.3g}..{self.v.max().item():.3g} ({self.source})")

    def to_json(self) -> str:
        return json.dumps({"k_scale": self.k.tolist(), "v_scale": self.v.tolist()}, indent=1)


def load_scales(path: str | Path, num_layers: int, num_kv_heads: int) -> KvScales:
    """Scales from a JSON file ``{"k_scale": [[...] per layer], "v_scale": [...]}`` (what
    ``KvScales.to_json`` writes); refuses a file of another shape or with a scale that is not
    positive and finite."""
    data = json.loads(Path(path).read_text())
    out = []
    for name in ("k_scale", "v_scale"):
        if name not in data:
            raise ValueError(f"{path}: no {name!r} (keys: {', '.join(data)})")
        t = torch.tensor(data[name], dtype=torch.float32)
        if tuple(t.shape) != (num_layers, num_kv_heads):
            raise ValueError(f"{path}: {name} is {list(t.shape)} but the model has "
                             f"[num_layers={num_layers}, num_kv_heads={num_kv_heads}]")
        if not bool((torch.isfinite(t) & (t > 0)).all()):
            raise ValueError(f"{path}: every {name} must be positive and finite")
        out.append(t)
    return KvScales(out[0], out[1], f"from {path}")


def calibration_ids(tokenizer, text_path: Path = CALIBRATION_TEXT) -> list[int]:
    return tokenizer(text_path.read_text(), add_special_tokens=False)["input_ids"]


@torch.inference_mode()
def calibrate(forward, token_ids: list[int], num_layers: int, num_kv_heads: int, head_dim: int,
              block_size: int, dtype: torch.dtype, device: torch.device, source: str) -> KvScales:
    """Prefills ``token_ids`` (one sequence) with ``forward`` (forward_logits' contract) into a
    scratch cache of ``dtype`` and derives the scales from its largest magnitudes."""
    n = len(token_ids)
    if n == 0:
        raise ValueError("calibration needs at least one token")
    blocks = -(-n // block_size)
    shape = kernels.cache_shape(blocks, num_kv_heads, block_size, head_dim)
    caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
              for _ in range(num_layers)]

    def dev(values, dt=torch.int32):
        return torch.tensor(values, dtype=dt, device=device)

    on_gpu = device.type == "cuda"
    batch = AttentionBatch(caches, dev(list(range(n))), dev([list(range(blocks))]), dev([n]), is_decode=False,
                           query_starts=[0, n], context_lens=[0], cu_query_starts=dev([0, n]) if on_gpu else None,
                           max_query_len=n)
    positions = dev([list(range(n))])
    forward(dev([token_ids]), positions, batch, logits_rows=dev([n - 1]))
    # [L, Hkv]: the largest magnitude of each layer's and head's rows (unwritten rows are zero)
    k_amax = torch.stack([k.float().abs().amax(dim=(0, 2, 3)) for k, _ in caches]).cpu()
    v_amax = torch.stack([v.float().abs().amax(dim=(0, 2, 3)) for _, v in caches]).cpu()
    return KvScales(scales_from_amax(k_amax * CALIBRATION_HEADROOM), scales_from_amax(v_amax * CALIBRATION_HEADROOM),
                    f"calibrated on {n} tokens of {source}")
