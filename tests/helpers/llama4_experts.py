"""Llama 4's experts in the two layouts checkpoints hold them in: stacked, as transformers saves
them (``feed_forward.experts.gate_up_proj`` [E, H, 2I], gate columns then up columns, and
``down_proj`` [E, I, H]), and one tensor per expert and projection, as llm-compressor writes
them (``feed_forward.experts.{e}.gate_proj.weight`` [I, H], ``up_proj`` [I, H], ``down_proj``
[H, I]: nn.Linear's [out, in])."""

from __future__ import annotations

import re

import torch

# {prefix}.feed_forward.experts.{gate_up_proj | down_proj}
_STACKED = re.compile(r"(.*\.feed_forward\.experts)\.(gate_up_proj|down_proj)")
# {prefix}.feed_forward.experts.{e}.{projection}.weight
_PER_EXPERT = re.compile(
    r"(.*\.feed_forward\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight"
)


def unstacked(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` with each stacked expert tensor split into its experts' projections."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        match = _STACKED.fullmatch(name)
        if match is None:
            out[name] = tensor
            continue
        stem = match[1]
        for expert, stored in enumerate(tensor):
            if match[2] == "down_proj":
                out[f"{stem}.{expert}.down_proj.weight"] = stored.T.contiguous()
                continue
            gate, up = stored.T.chunk(2)
            out[f"{stem}.{expert}.gate_proj.weight"] = gate.contiguous()
            out[f"{stem}.{expert}.up_proj.weight"] = up.contiguous()
    return out


def stacked(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` with each layer's per-expert projections stacked back as transformers
    saves them (the inverse of `unstacked`)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in weights.items():
        match = _PER_EXPERT.fullmatch(name)
        if match is None:
            out[name] = tensor
        else:
            experts.setdefault(match[1], {}).setdefault(int(match[2]), {})[match[3]] = tensor
    for stem, by_expert in experts.items():
        order = [by_expert[e] for e in sorted(by_expert)]
        gate_up = [torch.cat([p["gate_proj"], p["up_proj"]]).T for p in order]
        out[f"{stem}.gate_up_proj"] = torch.stack(gate_up).contiguous()
        out[f"{stem}.down_proj"] = torch.stack([p["down_proj"].T for p in order]).contiguous()
    return out
