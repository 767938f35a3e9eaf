"""Server settings: listen address, auth, limits; validated once at start-up."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ds4pool.engine import EngineConfig
from ds4pool.errors import Ds4poolError
from ds4pool.output.processor import OutputConfig

DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class TenantConfig:
    """One API key's tenant: sessions are namespaced by `name`."""

    name: str
    default_priority: int = 0
    weight: float = 1.0
    max_concurrent: int = 0  # requests in flight at once; 0 = unlimited


@dataclass(frozen=True)
class ServerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: dict[str, TenantConfig] = field(default_factory=dict)  # key → tenant
    admin_token: str | None = None
    metrics_auth: bool = False  # /metrics requires the admin token
    max_body_mb: float = 16.0
    served_model_name: str | None = None  # reported by /v1/models; default: --model
    request_timeout_s: float = 0.0  # 0: no deadline
    output: OutputConfig = field(default_factory=OutputConfig)  # tool-call / reasoning parsers

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys)


def api_keys_from(keys: list[str], keys_file: Path | None) -> dict[str, TenantConfig]:
    """--api-key KEY (each its own tenant, named key-1, key-2, ...) and --api-keys-file.

    The file is JSON: {"KEY": {"tenant": "team-a", "priority": 0, "weight": 1.0,
    "max_concurrent": 8}, ...}; a value may also be just the tenant name.
    """
    out: dict[str, TenantConfig] = {}
    for i, key in enumerate(keys, 1):
        if not key:
            raise Ds4poolError("--api-key must not be empty")
        out[key] = TenantConfig(name=f"key-{i}")
    if keys_file is None:
        return out
    try:
        data = json.loads(keys_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise Ds4poolError(f"cannot read --api-keys-file {keys_file}: {exc}") from None
    if not isinstance(data, dict):
        raise Ds4poolError(f"{keys_file}: expected a JSON object of key → tenant")
    for key, spec in data.items():
        if isinstance(spec, str):
            spec = {"tenant": spec}
        if not isinstance(spec, dict) or not isinstance(spec.get("tenant"), str) or not key:
            raise Ds4poolError(f"{keys_file}: entry for a key needs a 'tenant' name")
        try:
            out[key] = TenantConfig(
                name=spec["tenant"],
                default_priority=int(spec.get("priority", 0)),
                weight=float(spec.get("weight", 1.0)),
                max_concurrent=int(spec.get("max_concurrent", 0)),
            )
        except (TypeError, ValueError):
            raise Ds4poolError(f"{keys_file}: bad priority/weight/max_concurrent") from None
    return out
