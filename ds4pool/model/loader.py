"""Load a local Hugging Face model directory (or a named random preset) onto a device.

A directory needs config.json, *.safetensors (one file, or shards listed in
model.safetensors.index.json) and tokenizer.json; tokenizer_config.json,
generation_config.json and chat_template.jinja are read when present.
Every failure a user can cause is a ModelLoadError naming the file at fault.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open

from ds4pool.errors import ModelLoadError
from ds4pool.model.config import ModelConfig
from ds4pool.model.deepseek_v3 import DeepseekV3ForCausalLM
from ds4pool.model.layers import RotaryEmbedding, rope_inv_freq
from ds4pool.model.llama import LlamaForCausalLM
from ds4pool.model.registry import SKIP, family_for
from ds4pool.model.tokenizer import Tokenizer
from ds4pool.progress import Progress

if TYPE_CHECKING:
    from ds4pool.model.scripted import ScriptedForCausalLM

# The decoder classes of the registry's families (model/registry.py).
CausalLM = LlamaForCausalLM | DeepseekV3ForCausalLM

# Checkpoint tensors the model does not need (precomputed RoPE tables in old exports).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class LoadedModel:
    model: CausalLM | ScriptedForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    name: str  # what the user passed to --model
    path: Path | None  # the HF directory, None for random presets built in memory
    device: torch.device
    dtype: torch.dtype
    weights_id: str  # identifies the weights: part of the KV snapshot fingerprint


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"missing file: {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot parse {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"cannot parse {path}: expected a JSON object")
    return data


def load_config(directory: Path) -> ModelConfig:
    if not directory.is_dir():
        raise ModelLoadError(f"model directory not found: {directory}")
    return ModelConfig.from_hf(read_json(directory / "config.json"))


def weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"cannot parse {index}: no weight_map")
        files = [directory / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"no *.safetensors weights found in {directory}")
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"missing file: {f} (listed in {index.name})")
    return files


def weights_identity(files: list[Path]) -> str:
    """Hash of each file's name, size and safetensors header (names, dtypes, shapes,
    offsets) plus its first and last MiB of data: cheap even for 100 GB checkpoints,
    and any re-export or fine-tune changes it."""
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise ModelLoadError(f"corrupt safetensors file (truncated header): {f}")
            (header_len,) = struct.unpack("<Q", head)
            h.update(fh.read(min(header_len, 100 << 20)))
            h.update(fh.read(1 << 20))
            fh.seek(max(size - (1 << 20), 0))
            h.update(fh.read(1 << 20))
    return h.hexdigest()[:32]


def build_empty(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """Allocate the registry's model for `cfg.architecture` on `device` in `dtype` without
    initialising (no fp32 detour)."""
    with torch.device("meta"):
        model = family_for(cfg.architecture).model_class(cfg)
    assert isinstance(model, (LlamaForCausalLM, DeepseekV3ForCausalLM))
    model = model.to(dtype)
    for module in getattr(model, "float32_modules", list)():
        module.float()  # a family's modules that stay float32 (DeepSeek's routers)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    reset_buffers(model, device)
    return model.eval().requires_grad_(False)


def reset_buffers(model: CausalLM, device: torch.device) -> None:
    # Non-persistent buffers are not in checkpoints; recompute them in float32 on device.
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.inv_freq = rope_inv_freq(module.dim, module.rope).to(device)


def checkpoint_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint fills: parameters (tied ones under each name) and persistent buffers."""
    tensors = dict(model.named_parameters(remove_duplicate=False))
    for mod_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                tensors[f"{mod_name}.{name}" if mod_name else name] = buf
    return tensors


def load_weights(model: CausalLM, files: list[Path], show_progress: bool) -> None:
    """Copy each checkpoint tensor where the family's mapping puts it (model/registry.py);
    every parameter must be covered, element for element."""
    cfg = model.config
    map_weight = family_for(cfg.architecture).map_weight
    params = checkpoint_tensors(model)
    written: dict[str, int] = dict.fromkeys(params, 0)  # elements copied into each
    total = sum(f.stat().st_size for f in files)
    with Progress("loading weights", total, enabled=show_progress) as bar:
        for f in files:
            try:
                with safe_open(str(f), framework="pt", device="cpu") as st:
                    for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                        if name.endswith(IGNORED_SUFFIXES):
                            continue
                        target = map_weight(name, cfg)
                        if target == SKIP:
                            continue
                        if target.name not in params:
                            raise ModelLoadError(f"unexpected tensor {name!r} in {f}")
                        tensor = st.get_tensor(name)
                        dst = params[target.name].data
                        dst = dst[target.index] if target.index else dst
                        if tuple(tensor.shape) != tuple(dst.shape):
                            raise ModelLoadError(
                                f"tensor {name!r} in {f} has shape {tuple(tensor.shape)}, "
                                f"config implies {tuple(dst.shape)}"
                            )
                        dst.copy_(tensor)
                        written[target.name] += dst.numel()
                        bar.advance(tensor.numel() * tensor.element_size())
            except (SafetensorError, OSError, RuntimeError) as exc:
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise ModelLoadError(f"corrupt safetensors file {f}: {first}") from None
    missing = {n for n, t in params.items() if written[n] != t.numel()}
    if cfg.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        shown = ", ".join(sorted(missing)[:3])
        raise ModelLoadError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {shown}")


def tokenizer_identity(directory: Path) -> str:
    """Hash of the files that decide a tokenizer's ids and template."""
    h = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        f = directory / name
        if f.is_file():
            h.update(name.encode() + f.read_bytes())
    return h.hexdigest()[:32]


def load_model(
    spec: str,
    device: torch.device,
    dtype: torch.dtype,
    *,
    show_progress: bool = False,
    cache_dir: Path | None = None,
    tokenizer_dir: Path | None = None,
) -> LoadedModel:
    """Load `spec`: 'demo', 'random:<preset>', 'scripted:RULES.json', or a path to a Hugging
    Face directory. `tokenizer_dir` (random and scripted only) replaces the demo tokenizer."""
    from ds4pool.model import demo  # demo imports this module

    if spec.startswith("scripted:"):
        return load_scripted_model(spec, device, tokenizer_dir or demo.ensure_demo_model(cache_dir))
    if spec.startswith("random:"):
        return demo.load_random_preset(
            spec, device, dtype, cache_dir=cache_dir, tokenizer_dir=tokenizer_dir
        )
    if tokenizer_dir is not None:
        raise ModelLoadError(
            "--tokenizer applies to random:* and scripted:* models; a model directory "
            "brings its own tokenizer"
        )
    if spec == "demo":
        directory = demo.ensure_demo_model(cache_dir)
    else:
        directory = Path(spec).expanduser()
    cfg = load_config(directory)
    files = weight_files(directory)
    tokenizer = Tokenizer.from_dir(directory)
    model = build_empty(cfg, device, dtype)
    load_weights(model, files, show_progress)
    model.fuse_projections()  # HF names on disk, fused matmuls in memory
    return LoadedModel(
        model=model,
        config=cfg,
        tokenizer=tokenizer,
        name=spec,
        path=directory,
        device=device,
        dtype=dtype,
        weights_id=weights_identity(files),
    )


def load_scripted_model(spec: str, device: torch.device, tokenizer_dir: Path) -> LoadedModel:
    from ds4pool.model.scripted import load_scripted  # scripted's LoadedModel type is ours

    tokenizer = Tokenizer.from_dir(tokenizer_dir)
    model, cfg, weights_id = load_scripted(
        spec, tokenizer, tokenizer_identity(tokenizer_dir), device
    )
    return LoadedModel(
        model=model,
        config=cfg,
        tokenizer=tokenizer,
        name=spec,
        path=None,
        device=device,
        dtype=torch.float32,
        weights_id=weights_id,
    )
