"""The monitoring files in grafana/ agree with each other and with what ds4pool exports.

The dashboard, alert rules, Prometheus config, Grafana provisioning and compose file are
checked statically; the rules are also checked and unit-tested with promtool when it is
installed (Debian/Ubuntu: `apt-get install prometheus`).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ds4pool.metrics import Metrics

yaml = pytest.importorskip("yaml")

GRAFANA = Path(__file__).resolve().parents[2] / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "ds4pool.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
ROWS = ["Traffic", "Latency", "Batching", "Sessions", "Health", "Replicas"]
ALERTS = {"Ds4poolDown", "QueueBacklogSustained", "TTFTp95OverSLO", "DiskTierNearBudget",
          "SnapshotErrors"}  # fmt: skip
METRIC_RE = re.compile(r"\bds4pool_[A-Za-z0-9_]+")
# Series that Prometheus itself records for every target.
PROMETHEUS_SERIES = {"up"}
# Grafana's own variables, replaced before a query reaches Prometheus.
GRAFANA_VARS = {"$__rate_interval": "5m", "$__interval": "1m", "$instance": ".*"}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def load_yaml(name: str) -> Any:
    return yaml.safe_load((GRAFANA / name).read_text(encoding="utf-8"))


def all_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # panels inside collapsed rows


def panel_exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in all_panels(dashboard) for t in p.get("targets", [])]


def variable_queries(dashboard: dict[str, Any]) -> list[str]:
    out = []
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            q = var["query"]
            out.append(q["query"] if isinstance(q, dict) else q)
    return out


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in load_yaml("alerts.yml")["groups"] for rule in group["rules"]]


def exported_names() -> set[str]:
    """Every series name a fresh Metrics exposes (with _bucket/_sum/_count/_total/_info)."""
    names = set()
    for family in Metrics().registry.collect():
        # every family is pre-created with at least one child, so its samples show all
        # of its series names
        assert family.samples, f"{family.name} has no samples on a fresh Metrics"
        names.update(s.name for s in family.samples if not s.name.endswith("_created"))
    return names


def test_dashboard_shape(dashboard: dict[str, Any]) -> None:
    assert dashboard["schemaVersion"] >= 38  # Grafana 10+
    assert dashboard["title"] == "ds4pool" and dashboard["uid"]
    ids = [p["id"] for p in all_panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert rows == ROWS
    # every row has panels under it
    kinds = [p["type"] for p in dashboard["panels"]]
    starts = [i for i, k in enumerate(kinds) if k == "row"] + [len(kinds)]
    assert all(b - a > 1 for a, b in zip(starts, starts[1:]))


def test_panels_do_not_overlap(dashboard: dict[str, Any]) -> None:
    cells: dict[tuple[int, int], int] = {}
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps panel {cells[(x, y)]}"
                cells[(x, y)] = p["id"]


def test_datasource_variable_and_no_hard_coded_uid(dashboard: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    for p in all_panels(dashboard):
        if p["type"] == "row":
            continue
        assert p["datasource"] == DATASOURCE, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"] == DATASOURCE, p["title"]
            assert t["expr"].strip(), p["title"]
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"] == DATASOURCE, v["name"]

    # anywhere in the file: a Prometheus datasource is only ever the variable
    def walk(node: Any) -> Iterator[Any]:
        if isinstance(node, dict):
            if "datasource" in node:
                yield node["datasource"]
            for value in node.values():
                yield from walk(value)
        elif isinstance(node, list):
            for value in node:
                yield from walk(value)

    for ref in walk(dashboard):
        assert isinstance(ref, dict), f"datasource by name: {ref!r}"
        if ref.get("type") != "grafana":  # the built-in annotations source
            assert ref == DATASOURCE, ref


def test_every_referenced_metric_is_exported(dashboard: dict[str, Any]) -> None:
    exported = exported_names()
    used = {
        "dashboard": panel_exprs(dashboard) + variable_queries(dashboard),
        "alerts.yml": [r["expr"] for r in alert_rules()],
    }
    for where, exprs in used.items():
        for expr in exprs:
            for name in METRIC_RE.findall(expr):
                assert name in exported, f"{where}: {name} is not exported by Metrics ({expr})"


def test_the_dashboard_shows_every_metric(dashboard: dict[str, Any]) -> None:
    text = " ".join(panel_exprs(dashboard))
    shown = set(METRIC_RE.findall(text))
    for family in Metrics().registry.collect():
        names = {s.name for s in family.samples} - {f"{family.name}_created"}
        assert names & shown, f"no panel shows {family.name}"


def test_alert_rules() -> None:
    rules = alert_rules()
    assert {r["alert"] for r in rules} == ALERTS
    for r in rules:
        assert r["labels"]["severity"] in ("critical", "warning"), r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]
    down = next(r for r in rules if r["alert"] == "Ds4poolDown")
    assert re.fullmatch(r'up\{job="ds4pool"\}\s*==\s*0', down["expr"].strip())
    # the unit tests show each alert both firing and staying quiet
    firing: set[str] = set()
    quiet: set[str] = set()
    for test in load_yaml("alerts_test.yml")["tests"]:
        for case in test.get("alert_rule_test", []):
            (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
    assert firing == ALERTS and quiet == ALERTS


def test_prometheus_scrapes_ds4pool() -> None:
    cfg = load_yaml("prometheus.yml")
    assert cfg["rule_files"] == ["alerts.yml"]
    [job] = [j for j in cfg["scrape_configs"] if j["job_name"] == "ds4pool"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    assert job["static_configs"][0]["targets"] == ["ds4pool:8000"]


def test_compose_and_provisioning_agree() -> None:
    compose = load_yaml("docker-compose.yml")
    services = compose["services"]
    assert {"ds4pool", "prometheus", "grafana"} <= services.keys()
    build = services["ds4pool"]["build"]
    context = (GRAFANA / build["context"]).resolve()
    assert (context / build["dockerfile"]).is_file()
    assert (context / "pyproject.toml").is_file()
    assert "8000:8000" in services["ds4pool"]["ports"]

    def mounts(service: str) -> dict[str, str]:
        out = {}
        for spec in services[service]["volumes"]:
            src, dst = spec.split(":")[:2]
            if src.startswith("."):
                assert (GRAFANA / src).exists(), f"{service}: {src} does not exist"
            out[dst] = src
        return out

    prom = mounts("prometheus")
    assert prom["/etc/prometheus/prometheus.yml"] == "./prometheus.yml"
    assert prom["/etc/prometheus/alerts.yml"] == "./alerts.yml"  # rule_files is relative
    graf = mounts("grafana")
    assert graf["/etc/grafana/provisioning"] == "./provisioning"

    [provider] = load_yaml("provisioning/dashboards/ds4pool.yml")["providers"]
    assert graf[provider["options"]["path"]] == "./dashboards"
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/{DASHBOARD.name}"

    [ds] = load_yaml("provisioning/datasources/prometheus.yml")["datasources"]
    assert ds["type"] == "prometheus" and ds["url"] == "http://prometheus:9090"
    assert ds["isDefault"] is True
    scrape = load_yaml("prometheus.yml")["global"]["scrape_interval"]
    assert ds["jsonData"]["timeInterval"] == scrape  # keeps $__rate_interval right


# ------------------------------------------------------------------ promtool

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool is not installed (Debian/Ubuntu: apt-get install prometheus)",
)


def promtool(*args: str, cwd: Path = GRAFANA) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


@needs_promtool
def test_promtool_check_rules() -> None:
    r = promtool("check", "rules", "alerts.yml")
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_promtool_test_rules() -> None:
    r = promtool("test", "rules", "alerts_test.yml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


@needs_promtool
def test_promtool_check_config() -> None:
    r = promtool("check", "config", "prometheus.yml")
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_dashboard_queries_are_valid_promql(dashboard: dict[str, Any], tmp_path: Path) -> None:
    """promtool parses every panel and variable query (as recording rules)."""
    queries = panel_exprs(dashboard)
    for q in variable_queries(dashboard):
        # label_values(metric, label) is Grafana's; what it runs is a series query
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", q.strip())
        queries.append(f"group by ({m.group(2)}) ({m.group(1)})" if m else q)
    rules = []
    for i, q in enumerate(queries):
        for var, value in GRAFANA_VARS.items():
            q = q.replace(var, value)
        assert "$" not in q, f"unknown Grafana variable in {q}"
        rules.append({"record": f"dashboard:query_{i}", "expr": q})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = promtool("check", "rules", str(path), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
