"""Model configurations for ``forge-optim bench``: published shapes, random weights, no download.

Each entry gives the Hugging Face ``model_type`` and the config fields of the released model that
matter for a training step (vocabulary, widths, depth, heads, tied embeddings, RoPE). The weights are
random: ``build_model`` instantiates the architecture from the config directly on the target device
in the target dtype, so an 8B model is ready in seconds on a GPU.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Published shapes (config.json of each release). tie_word_embeddings is True where the released
# checkpoint ties lm_head to the input embedding (Qwen3 0.6B, 1.7B and 4B), False elsewhere.
_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}

MODELS: dict[str, dict[str, Any]] = {
    "Llama-3.1-8B": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=_LLAMA31_ROPE, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        hidden_act="silu", bos_token_id=128000, eos_token_id=128001),
    "Qwen3-0.6B": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=True, attention_bias=False, hidden_act="silu"),
    "Qwen3-1.7B": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=True, attention_bias=False, hidden_act="silu"),
    "Qwen3-4B": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=True, attention_bias=False, hidden_act="silu"),
    "Qwen3-8B": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=False, attention_bias=False, hidden_act="silu"),
    "Qwen3-14B": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=17408,
        num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=False, attention_bias=False, hidden_act="silu"),
    "Qwen3-32B": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=25600,
        num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=False, attention_bias=False, hidden_act="silu"),
    # A few-hundred-thousand-parameter Llama for CPU runs and tests.
    "tiny": dict(
        model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, hidden_act="silu"),
}

# Parameter counts of the released models (for checking the shapes above), in billions.
PUBLISHED_PARAMS_B = {"Llama-3.1-8B": 8.03, "Qwen3-0.6B": 0.596, "Qwen3-1.7B": 1.72, "Qwen3-4B": 4.02,
                      "Qwen3-8B": 8.19, "Qwen3-14B": 14.77, "Qwen3-32B": 32.76}


def model_names() -> list[str]:
    return list(MODELS)


def config_dict(model: str | None = None, config_path: str | None = None, layers: int | None = None) -> dict:
    """The config fields for a named model or a Hugging Face config.json file, with an optional depth override."""
    if config_path:
        d = json.loads(Path(config_path).read_text())
        if "model_type" not in d:
            raise ValueError(f"{config_path}: a Hugging Face config needs 'model_type'")
    else:
        if model not in MODELS:
            raise ValueError(f"unknown model {model!r}; choose from {', '.join(MODELS)} or pass --config")
        d = dict(MODELS[model])
    if layers is not None:
        d["num_hidden_layers"] = int(layers)
    return d


def hf_config(d: dict):
    from transformers import AutoConfig

    d = dict(d)
    model_type = d.pop("model_type")
    d.pop("architectures", None)
    d.pop("torch_dtype", None)
    d.pop("dtype", None)
    cfg = AutoConfig.for_model(model_type, **d)
    cfg.use_cache = False
    return cfg


def count_params(d: dict) -> dict:
    """Parameter counts from the config alone (no allocation): total, and the matmul parameters
    (everything except an untied input embedding, which is a lookup, not a GEMM)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(hf_config(d))
    total = sum(p.numel() for p in m.parameters())  # parameters() deduplicates tied weights
    emb = m.get_input_embeddings().weight.numel()
    tied = bool(getattr(m.config, "tie_word_embeddings", False))
    matmul = total if tied else total - emb
    return {"total": total, "matmul": matmul, "embedding": emb, "tied": tied}


def build_model(d: dict, device, dtype, attn_implementation: str = "sdpa"):
    """Random-weight causal LM built directly on ``device`` in ``dtype`` (no CPU round trip)."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = hf_config(d)
    prev = torch.get_default_dtype()
    try:
        with torch.device(device):
            try:
                model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn_implementation)
            except TypeError:  # older transformers spell it torch_dtype
                model = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype,
                                                         attn_implementation=attn_implementation)
    finally:
        torch.set_default_dtype(prev)
    model.to(dtype)
    model.train()
    return model
