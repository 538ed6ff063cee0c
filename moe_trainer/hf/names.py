"""Hugging Face parameter names <-> ours: ours are Hugging Face's minus the `model.` prefix, except the
multi-token-prediction modules (DeepSeek's layers after the main ones) and the experts (per-expert
keys here; read.py stacks them)."""
from __future__ import annotations

import re
from typing import Optional

_EXPERT_KEY = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.*)$")
_MTP_KEY = re.compile(r"^mtp\.(\d+)\.(.*)$")
_MTP_OWN = ("enorm.", "hnorm.", "eh_proj.")
_MTP_COPIES = ("embed_tokens.weight", "shared_head.head.weight")  # DeepSeek's copies of the main ones
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")  # derived buffers some old checkpoints carry


def hf_to_our_name(name: str, num_hidden_layers: int) -> Optional[str]:
    """HF key -> our key (None: a key we skip on purpose). Experts stay per-expert here."""
    if name == "lm_head.weight":
        return name
    if not name.startswith("model."):
        return "?" + name  # unknown: reported as unexpected
    rest = name[len("model."):]
    m = _LAYER_KEY.match(rest)
    if m is None or int(m[1]) < num_hidden_layers:
        return rest
    k, sub = int(m[1]) - num_hidden_layers, m[2]
    if sub in _MTP_COPIES:
        return None
    if sub.startswith(_MTP_OWN):
        return f"mtp.{k}.{sub}"
    if sub.startswith("shared_head.norm."):
        return f"mtp.{k}.norm.{sub[len('shared_head.norm.'):]}"
    return f"mtp.{k}.block.{sub}"


def our_to_hf_name(name: str, num_hidden_layers: int) -> str:
    if name == "lm_head.weight":
        return name
    m = _MTP_KEY.match(name)
    if m is None:
        return "model." + name
    layer, sub = num_hidden_layers + int(m[1]), m[2]
    if sub.startswith("block."):
        sub = sub[len("block."):]
    elif sub.startswith("norm."):
        sub = "shared_head." + sub
    return f"model.layers.{layer}.{sub}"
