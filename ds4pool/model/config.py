"""Model configuration: a frozen dataclass built once from a Hugging Face config.json.

The model code never sees Hugging Face config objects; everything it needs is here,
validated at construction so a bad checkpoint fails at load time with one clear line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ds4pool.errors import ModelLoadError

# Architectures and the per-family switches of their config.json. A plain dict: adding a
# Llama-family variant is one line here, plus its model class and weight mapping in
# model/registry.py (a test keeps the two tables' keys equal).
ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True},
    "Qwen3MoeForCausalLM": {"qkv_bias": False, "qk_norm": True},
    "MixtralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "DeepseekV3ForCausalLM": {"qkv_bias": False, "qk_norm": False},
}
# Architectures with multi-head latent attention (their KV cache is the latent: `MLAConfig`).
MLA_ARCHITECTURES = ("DeepseekV3ForCausalLM",)

# How a router turns a token's expert logits into top-k (weights, ids); model/moe.py.
ROUTERS = (
    "softmax_topk",  # Qwen3-MoE: softmax over all experts, top-k, renormalise if norm_topk_prob
    "topk_softmax",  # Mixtral: top-k logits, softmax over those k
    "sigmoid_group_topk",  # DeepSeek-V3: sigmoid, bias-corrected group-limited top-k, scaled
)

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # "default" | "llama3" | "yarn"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # yarn only (DeepSeek-V3): the ramp between extrapolated and interpolated frequencies,
    # and the magnitude scales (cos/sin by attention_factor, the softmax by mscale_all_dim).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3). Per token the cache holds one latent of
    kv_lora_rank values (normed) and qk_rope_head_dim rotated key values shared by all heads;
    kv_b_proj lifts the first to per-head keys (qk_nope_head_dim) and values (v_head_dim)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: one q_proj; else q_a_proj → norm → q_b_proj
    rope_interleave: bool = True  # DeepSeek's rotary pairs are adjacent dims (x0, x1), ...

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values per token and layer in the cache."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts part of a config: which layers are sparse and how they route.

    An expert is a gated SiLU MLP of `intermediate_size`; a sparse layer sends each token to
    `top_k` of `num_experts` experts and sums their outputs weighted by the router.
    """

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    router: str  # one of ROUTERS
    sparse_layers: tuple[int, ...]  # layer indices with an MoE block; the others are dense
    norm_topk_prob: bool = False  # renormalise the k weights to sum to 1
    # DeepSeek-V3 routing: experts in n_group groups, tokens pick among topk_group of them
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0  # always-on experts (DeepSeek), intermediate_size each

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ModelLoadError(f"unknown MoE router {self.router!r}; known: {', '.join(ROUTERS)}")
        if not 0 < self.top_k <= self.num_experts:
            raise ModelLoadError(
                f"num_experts_per_tok={self.top_k} must be in [1, num_experts={self.num_experts}]"
            )
        if self.intermediate_size <= 0:
            raise ModelLoadError(f"expert intermediate size {self.intermediate_size} must be > 0")
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ModelLoadError(
                f"n_group={self.n_group} must divide num_experts={self.num_experts} and "
                f"topk_group={self.topk_group} must be in [1, n_group]"
            )

    def expert_bytes(self, hidden_size: int, element_size: int) -> int:
        """Weights of one expert (gate, up and down projections)."""
        return 3 * hidden_size * self.intermediate_size * element_size


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rms_norm_eps: float
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v/o biases (Llama's attention_bias)
    qkv_bias: bool = False  # q/k/v biases only (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    mlp_bias: bool = False
    sliding_window: int | None = None
    torch_dtype: str = "float32"  # the checkpoint's own dtype
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoEConfig | None = None  # None: every layer has the dense MLP
    mla: MLAConfig | None = None  # set for latent-attention models (head_dim = qk_head_dim)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"config value {name}={getattr(self, name)} must be > 0")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def kv_cache(self) -> tuple[str, int, int, int]:
        """What one token stores per layer: (KVLayout kind, planes, heads, dim)."""
        if self.mla is not None:
            return ("mla", 1, 1, self.mla.latent_dim)
        return ("kv", 2, self.num_kv_heads, self.head_dim)

    def kv_bytes_per_token(self, element_size: int) -> int:
        """Bytes of KV (K and V, or the MLA latent) one token occupies across all layers."""
        _, planes, heads, dim = self.kv_cache
        return planes * self.num_layers * heads * dim * element_size

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a parsed config.json; raises ModelLoadError with one line on bad input."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in ARCHITECTURES:
            supported = ", ".join(ARCHITECTURES)
            raise ModelLoadError(
                f"unsupported architecture {arch!r}; supported: {supported}"
            ) from None
        family = ARCHITECTURES[arch]
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            head_dim = cfg.get("head_dim") or hidden // heads
            mla = _mla_from_hf(cfg) if arch in MLA_ARCHITECTURES else None
            if mla is not None:  # HF's head_dim is the rope width there; ours the q/k width
                head_dim = mla.qk_head_dim
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
            sliding = cfg.get("sliding_window")
            if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
                sliding = None
            if arch.startswith("Qwen3") and not cfg.get("use_sliding_window", False):
                sliding = None
            num_layers = int(cfg["num_hidden_layers"])
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=num_layers,
                num_heads=heads,
                num_kv_heads=heads if mla else int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                max_position=int(cfg.get("max_position_embeddings", 4096)),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope=_rope_from_hf(cfg, allow_yarn=mla is not None),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", False)),
                qkv_bias=family["qkv_bias"],
                qk_norm=family["qk_norm"],
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                sliding_window=int(sliding) if sliding else None,
                torch_dtype=_dtype_name(cfg.get("torch_dtype") or cfg.get("dtype")),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                moe=_moe_from_hf(arch, cfg, num_layers),
                mla=mla,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"config.json: missing or invalid field {exc}") from None


def _moe_from_hf(arch: str, cfg: dict[str, Any], num_layers: int) -> MoEConfig | None:
    if arch == "MixtralForCausalLM":
        return MoEConfig(
            num_experts=int(cfg["num_local_experts"]),
            top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["intermediate_size"]),
            router="topk_softmax",
            sparse_layers=tuple(range(num_layers)),
        )
    if arch == "Qwen3MoeForCausalLM":
        # Qwen's own config.json says num_experts; transformers 5 writes num_local_experts
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        if experts == 0:  # transformers' rule: no experts, every layer dense
            return None
        step = int(cfg.get("decoder_sparse_step", 1))
        dense = set(cfg.get("mlp_only_layers") or ())
        return MoEConfig(
            num_experts=experts,
            top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["moe_intermediate_size"]),
            router="softmax_topk",
            sparse_layers=tuple(
                i for i in range(num_layers) if i not in dense and (i + 1) % step == 0
            ),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        )
    if arch == "DeepseekV3ForCausalLM":
        # Missing keys take transformers' DeepseekV3Config defaults, as the reference would.
        experts = int(cfg.get("n_routed_experts", 256) or 0)
        if experts == 0:
            return None
        first_dense = int(cfg.get("first_k_dense_replace", 3) or 0)
        return MoEConfig(
            num_experts=experts,
            top_k=int(cfg.get("num_experts_per_tok", 8)),
            intermediate_size=int(cfg.get("moe_intermediate_size", 2048)),
            router="sigmoid_group_topk",
            sparse_layers=tuple(range(first_dense, num_layers)),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            n_group=int(cfg.get("n_group", 8) or 1),
            topk_group=int(cfg.get("topk_group", 4) or 1),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.5)),
            num_shared_experts=int(cfg.get("n_shared_experts", 1) or 0),
        )
    return None


def _dtype_name(value: object) -> str:
    name = str(value or "float32").removeprefix("torch.")
    return name if name in DTYPES else "float32"


def _mla_from_hf(cfg: dict[str, Any]) -> MLAConfig:
    q_lora = cfg.get("q_lora_rank")
    mla = MLAConfig(
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]),
        q_lora_rank=None if q_lora is None else int(q_lora),
        rope_interleave=bool(cfg.get("rope_interleave", True)),
    )
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        value = getattr(mla, name)
        if value <= 0 or (name == "qk_rope_head_dim" and value % 2):
            raise ModelLoadError(f"config value {name}={value} must be > 0 (and even for rope)")
    return mla


def _rope_from_hf(cfg: dict[str, Any], allow_yarn: bool = False) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (theta inside); older checkpoints
    # have `rope_theta` and an optional `rope_scaling` dict.
    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "yarn" and allow_yarn:
        # Only the latent-attention models take yarn: their rope runs in torch, where the
        # cos/sin magnitude scale is applied (the fused Triton rope of the Llama path has none).
        return _yarn_from_hf(cfg, params, theta)
    if kind != "llama3":
        supported = "default, llama3, yarn" if allow_yarn else "default, llama3"
        raise ModelLoadError(f"unsupported rope type {kind!r}; supported: {supported}")
    return RopeConfig(
        theta=theta,
        kind="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )


def _yarn_from_hf(cfg: dict[str, Any], params: dict[str, Any], theta: float) -> RopeConfig:
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor")
    if factor is None:  # DeepSeek-V3: the ratio of the context lengths (as transformers)
        factor = int(cfg.get("max_position_embeddings", 4096)) / original
    attention_factor = params.get("attention_factor")
    return RopeConfig(
        theta=theta,
        kind="yarn",
        factor=float(factor),
        original_max_position=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=None if attention_factor is None else float(attention_factor),
        truncate=bool(params.get("truncate", True)),
    )
