"""The model registry: architecture name (config.json's `architectures[0]`) → model class and
the mapping of checkpoint tensors onto its parameters.

Checkpoints keep Hugging Face names on disk; a family whose parameters differ (experts stacked
into one [E, ...] tensor, a module under another name) says where each checkpoint tensor goes
with a `WeightTarget`: a parameter name and an index into it, so `param[index] = tensor`.
The loader checks every parameter is covered exactly by what it copied.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from ds4pool.errors import UnsupportedArchitectureError
from ds4pool.model.config import ModelConfig
from ds4pool.model.deepseek_v3 import DeepseekV3ForCausalLM
from ds4pool.model.llama import LlamaForCausalLM

Index = tuple[int | slice, ...]


@dataclass(frozen=True)
class WeightTarget:
    name: str  # our parameter (or persistent buffer) name
    index: Index = ()  # where in it the checkpoint tensor goes; () = the whole tensor


WeightMapper = Callable[[str, ModelConfig], WeightTarget]

# What a mapper answers for a checkpoint tensor the model does not use (the loader skips it).
SKIP = WeightTarget("")


def same_name(name: str, cfg: ModelConfig) -> WeightTarget:
    return WeightTarget(name)


def expert_mapper(
    experts: str, gate: str, up: str, down: str, rename: dict[str, str] | None = None
) -> WeightMapper:
    """A mapper that stacks per-expert checkpoint tensors
    `{prefix}.{experts}.{e}.{gate|up|down}.weight` into our `{prefix}.experts.gate_up_proj`
    [E, 2I, H] (gate rows [0, I), up rows [I, 2I)) and `{prefix}.experts.down_proj` [E, H, I].
    `rename` replaces module names first (Mixtral's `block_sparse_moe.` → `mlp.`)."""
    pattern = re.compile(rf"^(.*)\.{re.escape(experts)}\.(\d+)\.(\w+)\.weight$")
    projections = {gate: 0, up: 1, down: 2}

    def map_weight(name: str, cfg: ModelConfig) -> WeightTarget:
        for old, new in (rename or {}).items():
            name = name.replace(old, new)
        m = pattern.match(name)
        if m is None or m.group(3) not in projections or cfg.moe is None:
            return WeightTarget(name)
        prefix, e, which = m.group(1), int(m.group(2)), projections[m.group(3)]
        if which == 2:
            return WeightTarget(f"{prefix}.experts.down_proj", (e,))
        i = cfg.moe.intermediate_size
        rows = slice(0, i) if which == 0 else slice(i, 2 * i)
        return WeightTarget(f"{prefix}.experts.gate_up_proj", (e, rows))

    return map_weight


def deepseek_v3_mapper() -> WeightMapper:
    """Experts stacked as Qwen3-MoE's; the layers past num_hidden_layers are skipped: DeepSeek's
    multi-token-prediction modules (`num_nextn_predict_layers`, layer 61 of DeepSeek-V3),
    which predict further tokens for speculative decoding and take no part in decoding."""
    experts = expert_mapper("experts", "gate_proj", "up_proj", "down_proj")
    layer = re.compile(r"^model\.layers\.(\d+)\.")

    def map_weight(name: str, cfg: ModelConfig) -> WeightTarget:
        m = layer.match(name)
        if m is not None and int(m.group(1)) >= cfg.num_layers:
            return SKIP
        return experts(name, cfg)

    return map_weight


@dataclass(frozen=True)
class ModelFamily:
    model_class: Callable[[ModelConfig], nn.Module]  # built on the meta device by the loader
    map_weight: WeightMapper = same_name


REGISTRY: dict[str, ModelFamily] = {
    "LlamaForCausalLM": ModelFamily(LlamaForCausalLM),
    "MistralForCausalLM": ModelFamily(LlamaForCausalLM),
    "Qwen2ForCausalLM": ModelFamily(LlamaForCausalLM),
    "Qwen3ForCausalLM": ModelFamily(LlamaForCausalLM),
    # The Llama decoder with a SparseMoeBlock (model/moe.py) as the MLP of sparse layers.
    "Qwen3MoeForCausalLM": ModelFamily(
        LlamaForCausalLM, expert_mapper("experts", "gate_proj", "up_proj", "down_proj")
    ),
    "MixtralForCausalLM": ModelFamily(
        LlamaForCausalLM,
        expert_mapper("experts", "w1", "w3", "w2", rename={".block_sparse_moe.": ".mlp."}),
    ),
    # Multi-head latent attention (model/mla.py) in every layer, dense MLPs in the first
    # first_k_dense_replace layers, DeepSeek's routed + shared experts in the others.
    "DeepseekV3ForCausalLM": ModelFamily(DeepseekV3ForCausalLM, deepseek_v3_mapper()),
}


def family_for(architecture: str) -> ModelFamily:
    family = REGISTRY.get(architecture)
    if family is None:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(REGISTRY)}"
        )
    return family
