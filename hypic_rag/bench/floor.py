"""The machine's floor for a prefill: recomputed FLOPs at the measured matmul peak plus loaded bytes at the
measured copy bandwidth. Both rates are measured at the start of a benchmark run, on the run's own threads.

A mode's distance from the floor is its time to first token divided by the floor: 1.0 would mean every cycle went
to the unavoidable matmuls and memory traffic.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class MachineRates:
    """matmul_flops_per_second: best fp32 GEMM rate seen; copy_bytes_per_second: best large-tensor copy rate
    (bytes read + written)."""

    matmul_flops_per_second: float
    copy_bytes_per_second: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def measure_rates(device: str | torch.device = "cpu", size: int = 1024, copy_mib: int = 256, repeats: int = 5) -> MachineRates:
    """Best of `repeats`: a [size, size] @ [size, size] fp32 matmul, and a clone of `copy_mib` MiB."""
    device = torch.device(device)
    left = torch.randn(size, size, device=device)
    right = torch.randn(size, size, device=device)
    source = torch.empty(copy_mib * 2**20 // 4, device=device)
    source.fill_(1.0)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
            began = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - began)
        return min(times)

    matmul_seconds = best(lambda: left @ right)
    copy_seconds = best(lambda: source.clone())
    return MachineRates(2.0 * size**3 / matmul_seconds, 2.0 * source.numel() * 4 / copy_seconds)


def prefill_flops(config: Any, recomputed_tokens: int, attended_keys: int) -> float:
    """FLOPs of running `recomputed_tokens` through a qwen3_5-style hybrid stack whose attention layers each see
    `attended_keys` keys per query: weight matmuls (2 x parameters touched per token, MLP / MoE active experts
    included), attention scores and values, and the delta rule's per-token state work."""
    hidden = config.hidden_size
    layer_types = list(config.layer_types)
    linear_layers = layer_types.count("linear_attention")
    attention_layers = layer_types.count("full_attention")
    # linear mixer projections: qkv (2 K heads x dk + V heads x dv), z (V x dv), b, a, out
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    linear_weights = hidden * (2 * key_dim + 2 * value_dim + 2 * config.linear_num_value_heads) + value_dim * hidden
    # gated attention: q (x2 for the gate), k, v, o
    head_dim = getattr(config, "head_dim", hidden // config.num_attention_heads)
    attention_weights = hidden * head_dim * (3 * config.num_attention_heads + 2 * config.num_key_value_heads)
    experts = getattr(config, "num_experts_per_tok", None)
    if experts:
        mlp_weights = 3 * hidden * config.moe_intermediate_size * experts + 3 * hidden * getattr(
            config, "shared_expert_intermediate_size", 0
        )
    else:
        mlp_weights = 3 * hidden * config.intermediate_size
    weights = linear_layers * linear_weights + attention_layers * attention_weights + len(layer_types) * mlp_weights
    weights += hidden * config.vocab_size / max(recomputed_tokens, 1)  # the LM head, for the last token only
    attention = attention_layers * 4 * config.num_attention_heads * head_dim * attended_keys
    delta_rule = linear_layers * 6 * config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    return recomputed_tokens * (2.0 * weights + attention + delta_rule)


def floor_seconds(rates: MachineRates, flops: float, loaded_bytes: float) -> float:
    """The least time the machine could take for `flops` of matmul work and `loaded_bytes` of memory traffic."""
    return flops / rates.matmul_flops_per_second + loaded_bytes / rates.copy_bytes_per_second
