"""The real coding-agent CLIs (Claude Code, Codex, opencode), installed from npm once.

`agent_cli(NAME)` returns the path of NAME's executable, installing the pinned versions into
$DS4POOL_AGENT_CLIS (default ~/.cache/ds4pool/agent-clis) on first use, so CI installs them
once; where npm is absent or the registry unreachable the test is skipped with the reason.
Each CLI runs with its own HOME (and CODEX_HOME) in a temp dir: nothing of the user's
configuration is read, nothing of it is written.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

# CLI name → (npm package, pinned version)
PACKAGES: dict[str, tuple[str, str]] = {
    "claude": ("@anthropic-ai/claude-code", "2.1.328"),
    "codex": ("@openai/codex", "0.169.0"),
    "opencode": ("opencode-ai", "1.18.33"),
}
INSTALL_TIMEOUT_S = 600


def clis_root() -> Path:
    env = os.environ.get("DS4POOL_AGENT_CLIS")
    return Path(env) if env else Path.home() / ".cache" / "ds4pool" / "agent-clis"


def _installed_version(root: Path, package: str) -> str | None:
    try:
        meta = json.loads((root / "node_modules" / package / "package.json").read_text())
    except (OSError, ValueError):
        return None
    return meta.get("version")


def _missing(root: Path) -> list[str]:
    return [
        f"{package}@{version}"
        for name, (package, version) in PACKAGES.items()
        if _installed_version(root, package) != version
        or not (root / "node_modules" / ".bin" / name).exists()
    ]


def agent_cli(name: str) -> Path:
    """The executable of agent CLI `name`, installed if needed; skips when npm cannot."""
    root = clis_root()
    binary = root / "node_modules" / ".bin" / name
    if not _missing(root):
        return binary
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: the agent CLIs cannot be installed")
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".install.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one installer at a time (parallel CI jobs)
        todo = _missing(root)
        if todo:
            cmd = [npm, "install", "--prefix", str(root), "--no-audit", "--no-fund", *todo]
            try:
                proc = subprocess.run(
                    cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S
                )
            except subprocess.TimeoutExpired:
                pytest.skip("npm install of the agent CLIs timed out (registry unreachable?)")
            if proc.returncode != 0:
                last = (proc.stderr.strip().splitlines() or ["?"])[-1]
                pytest.skip(f"npm install of the agent CLIs failed (registry unreachable?): {last}")
    if _missing(root):
        pytest.skip(f"agent CLIs missing after npm install: {', '.join(_missing(root))}")
    return binary


def isolated_env(home: Path, **extra: str) -> dict[str, str]:
    """A child environment with its own HOME and XDG dirs; PATH and PYTHONPATH kept."""
    keep = ("PATH", "LANG", "LC_ALL", "TERM", "TMPDIR", "SYSTEMROOT")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    home.mkdir(parents=True, exist_ok=True)
    env.update(
        HOME=str(home),
        XDG_CONFIG_HOME=str(home / ".config"),
        XDG_DATA_HOME=str(home / ".local" / "share"),
        XDG_STATE_HOME=str(home / ".local" / "state"),
        # Shared between runs: opencode installs its provider packages from npm in here.
        XDG_CACHE_HOME=str(clis_root() / "xdg-cache"),
        NO_COLOR="1",
        CI="1",
    )
    env.update(extra)
    return env
