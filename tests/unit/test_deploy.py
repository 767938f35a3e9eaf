"""deploy/: the HAProxy config is valid (`haproxy -c`) and routes as the scale-out needs; the
compose file parses, and its services, mounts, flags and Prometheus targets agree."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
HAPROXY = shutil.which("haproxy") or next(
    (p for p in ("/usr/sbin/haproxy",) if Path(p).exists()), None
)


def haproxy_cfg() -> str:
    return (DEPLOY / "haproxy.cfg").read_text()


@pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed (apt-get install haproxy)")
def test_haproxy_accepts_the_config() -> None:
    assert HAPROXY is not None
    r = subprocess.run(
        [HAPROXY, "-c", "-f", str(DEPLOY / "haproxy.cfg")], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Configuration file is valid" in r.stdout + r.stderr


def test_haproxy_routes_by_session_and_retries_only_unsent_requests() -> None:
    cfg = haproxy_cfg()
    lines = [ln.split("#")[0].strip() for ln in cfg.splitlines()]
    assert "balance hdr(X-Session-Id)" in lines
    assert "hash-type consistent" in lines
    assert "option httpchk GET /ready" in lines
    retry = next(ln for ln in lines if ln.startswith("retry-on "))
    # never a condition a request that reached a replica and got an answer could meet
    assert set(retry.split()[1:]) <= {"conn-failure", "empty-response", "503"}, retry
    assert "option http-buffer-request" in lines
    timeouts = dict(re.findall(r"^timeout (server|client) (\S+)$", "\n".join(lines), re.M))
    assert timeouts["server"].endswith("m") and timeouts["client"].endswith("m")  # SSE


def test_compose_runs_haproxy_two_replicas_on_one_store_prometheus_grafana() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert {"haproxy", "replica1", "replica2", "prometheus", "grafana"} <= set(services)
    servers = re.findall(r"^\s*server (\S+) (\S+):(\d+)", haproxy_cfg(), re.M)
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = prom["scrape_configs"][0]["static_configs"][0]["targets"]
    replicas = sorted(n for n in services if n.startswith("replica"))
    assert sorted(host for _, host, _ in servers) == replicas
    assert sorted(t.split(":")[0] for t in targets) == replicas
    ids = set()
    for name in replicas:
        svc = services[name]
        env = svc["environment"]
        assert env["DS4POOL_KV_DISK_DIR"] == "/store"
        assert "store:/store" in svc["volumes"]  # one volume: the shared store
        cmd = svc["command"]
        ids.add(cmd[cmd.index("--replica-id") + 1])
        assert float(env["DS4POOL_DRAIN_GRACE_S"]) > 2  # > HAProxy's inter 1s x fall 2
    assert len(ids) == len(replicas)  # every replica has its own id
    for svc in services.values():  # every relative bind mount exists in the repository
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (DEPLOY / src).exists(), src


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_the_prometheus_config(tmp_path: Path) -> None:
    # laid out as the compose file mounts them: the config next to grafana/'s alert rules
    shutil.copy(DEPLOY / "prometheus.yml", tmp_path / "prometheus.yml")
    shutil.copy(DEPLOY.parent / "grafana" / "alerts.yml", tmp_path / "alerts.yml")
    r = subprocess.run(
        ["promtool", "check", "config", "prometheus.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
