"""The numerical reference for model tests: transformers' Qwen3_5ForCausalLM on the same weights."""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open


def hf_model(model_dir: str | Path):
    """Load a checkpoint directory (ours or save_pretrained's) into transformers' Qwen3_5ForCausalLM, fp32."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    model_dir = Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    text = raw.get("text_config", raw)
    fields = {k: v for k, v in text.items() if k not in ("architectures", "model_type")}
    if "tie_word_embeddings" in raw:
        fields["tie_word_embeddings"] = raw["tie_word_embeddings"]
    config = Qwen3_5TextConfig(**fields)
    model = Qwen3_5ForCausalLM(config).float().eval()
    state = {}
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key.startswith("mtp."):
                    continue
                name = key.replace("model.language_model.", "model.", 1)
                state[name] = f.get_tensor(key).float()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"lm_head.weight"}, missing
    if config.tie_word_embeddings:
        model.tie_weights()
    _torch_kernels(model)
    return model


def _torch_kernels(model) -> None:
    """The reference runs on the CPU, so it takes transformers' torch functions for the gated delta rule and the
    conv: where fla-core or causal-conv1d is importable (the GPU hosts carry fla-core), transformers binds their
    CUDA kernels instead, and those refuse CPU tensors. Both ways transformers has bound them are undone: the
    module's decorated functions (newer releases; the torch function is the wrapper's __wrapped__) and the
    layer's attributes (older ones)."""
    module = sys.modules[type(model).__module__]
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                 "causal_conv1d_update"):
        function = getattr(module, name, None)
        if callable(function) and hasattr(function, "__wrapped__"):
            setattr(module, name, inspect.unwrap(function))
    for layer in model.modules():
        for attribute in ("chunk_gated_delta_rule", "recurrent_gated_delta_rule"):
            if hasattr(layer, attribute) and hasattr(module, "torch_" + attribute):
                setattr(layer, attribute, getattr(module, "torch_" + attribute))
        if hasattr(layer, "causal_conv1d_fn"):  # None: the layer's own conv
            layer.causal_conv1d_fn = None
        if hasattr(layer, "causal_conv1d_update") and hasattr(module, "torch_causal_conv1d_update"):
            layer.causal_conv1d_update = module.torch_causal_conv1d_update


@torch.inference_mode()
def hf_logits_and_hidden(model, tokens: list[int]):
    out = model(torch.tensor([tokens]), output_hidden_states=True, use_cache=False)
    return out.logits[0].float(), [h[0].float() for h in out.hidden_states]
