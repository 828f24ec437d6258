"""Throughput figures of a recipe card: tokens/s per GPU, $ per 1M tokens, MFU, GPU-hours.

MFU follows PaLM (nanoGPT, torchtitan): 6N + 12·L·H·Q·T FLOPs per token, N the active
parameters per token, L layers, H attention heads, Q head dimension, T sequence length; the
attention term is left out when the model's shape is not known (the reference cards do so too:
their MFU is 6N only). Peak dense BF16 FLOP/s per GPU: the datasheets' (derive/device_peaks.py,
the table the GPU judgement reads too); torchtitan's `get_peak_flops` (reference/FACTS.md §6)
rounds H100/H200's 989.5 to 989.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from traindx.derive import device_peaks

# the datasheets' dense BF16 rate of each device (derive/device_peaks.py: the one table; its
# names are the ones a card's gpu.type holds)
PEAK_BF16_TFLOPS = {
    key: peak.tflops["bf16"] for key, peak in device_peaks.PEAKS.items() if "bf16" in peak.tflops
}


def normalize_gpu(name: str | None) -> str | None:
    """'NVIDIA H200', 'h200', 'NVIDIA H100 PCIe' -> 'H200' / 'H100 PCIe'; None when unknown."""
    peak = device_peaks.match_device(name)
    return peak.key if peak is not None and peak.key in PEAK_BF16_TFLOPS else None


def peak_flops(gpu: str) -> float:
    flops = device_peaks.peak_flops(gpu, "bf16")
    if flops is None:
        raise ValueError(f"no peak FLOP/s known for GPU {gpu!r}; known: {', '.join(PEAK_BF16_TFLOPS)}")
    return flops


def flops_per_token(
    active_params: float,
    layers: int | None = None,
    heads: int | None = None,
    head_dim: int | None = None,
    seq_len: int | None = None,
) -> float:
    """6N, plus 12·L·H·Q·T when the whole attention shape is known."""
    flops = 6.0 * active_params
    if layers is not None and heads is not None and head_dim is not None and seq_len is not None:
        flops += 12.0 * layers * heads * head_dim * seq_len
    return flops


def mfu(
    tokens_per_s_per_gpu: float,
    gpu: str,
    active_params: float,
    layers: int | None = None,
    heads: int | None = None,
    head_dim: int | None = None,
    seq_len: int | None = None,
) -> float:
    """Model FLOPs utilisation, a fraction."""
    return (
        tokens_per_s_per_gpu
        * flops_per_token(active_params, layers, heads, head_dim, seq_len)
        / peak_flops(gpu)
    )


def usd_per_million_tokens(price_per_gpu_hour: float, tokens_per_s_per_gpu: float) -> float:
    """price per GPU-hour / (tokens/s/GPU × 3600) × 1e6."""
    return price_per_gpu_hour / (tokens_per_s_per_gpu * 3600.0) * 1e6


def gpu_hours(n_gpus: int, seconds: float) -> float:
    return n_gpus * seconds / 3600.0


def tokens_per_s_per_gpu(tokens: float, seconds: float, n_gpus: int) -> float:
    return tokens / seconds / n_gpus


# -- the model's shape from a HuggingFace config.json ------------------------------------------


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    # multimodal configs (Qwen3.5/3.6 VL, ...) keep the language model under text_config
    text: Mapping[str, Any] = config.get("text_config") or config.get("language_config") or config
    return text


def model_shape(config: Mapping[str, Any]) -> dict[str, Any]:
    """{'layers', 'heads', 'head_dim', 'hidden'} of a HF config dict."""
    c = _text_config(config)
    try:
        hidden = int(c["hidden_size"])
        layers = int(c["num_hidden_layers"])
        heads = int(c["num_attention_heads"])
    except KeyError as exc:
        raise ValueError(f"model config has no {exc.args[0]!r}") from None
    head_dim = int(c.get("head_dim") or hidden // heads)
    return {"layers": layers, "heads": heads, "head_dim": head_dim, "hidden": hidden}


def active_params_from_config(config: Mapping[str, Any]) -> float:
    """Parameters a token passes through (the matmuls): attention and MLP of every layer (for
    MoE: the router, top-k routed experts and any shared expert) and the output head. The
    input embedding is a lookup, not a matmul, and is not counted; norms are negligible.

    Linear-attention layers (Qwen3-Next/3.5 style) are counted as full attention: close, not
    exact, for hybrid models; pass --active-params for an exact figure.
    """
    c = _text_config(config)
    shape = model_shape(config)
    h, heads, hd, layers = shape["hidden"], shape["heads"], shape["head_dim"], shape["layers"]
    kv_heads = int(c.get("num_key_value_heads") or heads)
    attention = h * heads * hd + 2 * h * kv_heads * hd + heads * hd * h
    if c.get("attn_output_gate"):  # gated attention doubles the query projection
        attention += h * heads * hd
    experts = c.get("num_experts") or c.get("n_routed_experts") or c.get("num_local_experts")
    if experts:
        top_k = int(c.get("num_experts_per_tok") or c.get("moe_topk") or 1)
        expert_ffn = int(c.get("moe_intermediate_size") or c["intermediate_size"])
        mlp = top_k * 3 * h * expert_ffn + h * int(experts)
        shared = c.get("shared_expert_intermediate_size") or ((c.get("n_shared_experts") or 0) * expert_ffn)
        mlp += 3 * h * int(shared or 0)
    else:
        mlp = 3 * h * int(c["intermediate_size"])  # gated MLP: gate, up, down
    head = h * int(c["vocab_size"])
    total: float = layers * (attention + mlp) + head  # an int: a float only by annotation
    return total
