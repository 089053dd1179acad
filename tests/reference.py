"""The numerical reference for model tests: transformers' Qwen3_5ForCausalLM on the same weights."""

from __future__ import annotations

import json
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
    return model


@torch.inference_mode()
def hf_logits_and_hidden(model, tokens: list[int]):
    out = model(torch.tensor([tokens]), output_hidden_states=True, use_cache=False)
    return out.logits[0].float(), [h[0].float() for h in out.hidden_states]
