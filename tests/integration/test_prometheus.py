"""ds4pool scraped by a real Prometheus: every dashboard and alert query returns data.

Starts `ds4pool serve` as a subprocess on the demo model with tiny KV budgets (so sessions
move between the device, RAM and disk tiers) and a real Prometheus scraping it every second
with grafana/alerts.yml loaded. Runs a small concurrent agent workload with the openai SDK,
a few admin evictions and one invalid request, then evaluates every PromQL expression of
grafana/dashboards/ds4pool.json and grafana/alerts.yml through Prometheus's query API.

Skipped when `prometheus` is not installed (Debian/Ubuntu: apt-get install prometheus).
`promtool check/test rules` on the same files run in tests/unit/test_grafana.py.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import httpx
import openai
import pytest

from tests.integration.conftest import free_port

yaml = pytest.importorskip("yaml")

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="prometheus is not installed (Debian/Ubuntu: apt-get install prometheus)",
)

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "ds4pool.json"
ADMIN_TOKEN = "t"
TENANT = "default"  # requests without an API key
SCRAPE_S = 1
SESSIONS, TURNS, THREADS, MAX_TOKENS = 12, 2, 4, 8
EVICTIONS = 3  # sessions sent to disk by the admin API, then resumed (disk restores)
START_TIMEOUT_S = 60
SCRAPES_AFTER_WORKLOAD = 3

# Exceptions to "every expression returns data". An alert's full expression (its condition)
# legitimately returns nothing for this healthy workload, so each one is checked twice: the
# full expression must run and return nothing, and the expression without its trailing
# threshold must return a value. Alerts listed here (name → reason) are checked for parsing
# only; none need it today.
ALERT_PARSE_ONLY: dict[str, str] = {}
# Dashboard queries (panel title → reason) allowed to return no finite value. Every query
# must still parse and return at least one series.
DASHBOARD_NO_FINITE_VALUE: dict[str, str] = {}

COMPARISON_RE = re.compile(
    r"^(?P<expr>.*?)\s*(?:==|!=|>=|<=|>|<)\s*(?:bool\s+)?[-+]?[0-9.]+(?:e[-+]?[0-9]+)?\s*$",
    re.DOTALL | re.IGNORECASE,
)
VARIABLE_RE = re.compile(r"\$(\w+)|\$\{(\w+)(?::\w+)?\}")


# ------------------------------------------------------------------ processes


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 60) -> str:
        try:
            text = self.log.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"
        body = "\n".join(text.splitlines()[-lines:])
        return f"----- {self.name} (exit {self.popen.poll()}) log tail -----\n{body}"

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)


def start(name: str, argv: list[str], log: Path, **kw: Any) -> Proc:
    with log.open("wb") as out:
        popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, **kw)
    return Proc(name, popen, log)


@dataclass
class Stack:
    ds4pool: Proc
    prometheus: Proc
    api: str  # ds4pool base URL
    prom: str  # Prometheus base URL
    instance: str  # the target's instance label
    prom_started: float
    model: str = ""
    completed: int = 0  # generation requests that finished normally
    evicted: list[str] = field(default_factory=list)

    def logs(self) -> str:
        return f"\n{self.ds4pool.tail()}\n{self.prometheus.tail()}"

    def fail(self, message: str) -> NoReturn:
        pytest.fail(message + self.logs(), pytrace=False)

    def query(self, expr: str, at: float | None = None) -> dict[str, Any]:
        """An instant query: Prometheus's JSON answer (status, data or error)."""
        params = {"query": expr, **({"time": f"{at:.3f}"} if at is not None else {})}
        r = httpx.get(f"{self.prom}/api/v1/query", params=params, timeout=10)
        try:
            return r.json()
        except json.JSONDecodeError:
            return {"status": "error", "error": f"HTTP {r.status_code}: {r.text[:300]}"}

    def vector(self, expr: str) -> list[dict[str, Any]]:
        answer = self.query(expr)
        if answer.get("status") != "success":
            self.fail(f"query failed: {expr}\n{answer}")
        return answer["data"]["result"]

    def value(self, expr: str) -> float:
        """The value of a query that returns a single series (0 when it returns none)."""
        result = self.vector(expr)
        if len(result) > 1:
            self.fail(f"{expr} returned {len(result)} series, expected one: {result}")
        return float(result[0]["value"][1]) if result else 0.0


def wait_for(
    what: str, check: Callable[[], bool], stack_logs: Callable[[], str], timeout: float
) -> None:
    """Poll `check` every 0.1 s (connection errors count as not yet) until it is true."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (httpx.HTTPError, OSError, KeyError, ValueError, IndexError) as exc:
            last = exc
        time.sleep(0.1)
    pytest.fail(
        f"timed out after {timeout:.0f}s waiting for {what} (last error: {last!r})" + stack_logs(),
        pytrace=False,
    )


def prometheus_config(directory: Path, target: str) -> Path:
    """grafana/prometheus.yml with a 1 s scrape of the loopback target, and a copy of
    grafana/alerts.yml next to it (rule_files is relative to the config file)."""
    cfg = yaml.safe_load((GRAFANA / "prometheus.yml").read_text(encoding="utf-8"))
    cfg["global"] = {
        "scrape_interval": f"{SCRAPE_S}s",
        "scrape_timeout": f"{SCRAPE_S}s",
        "evaluation_interval": f"{SCRAPE_S}s",
    }
    [job] = [j for j in cfg["scrape_configs"] if j["job_name"] == "ds4pool"]
    job["static_configs"] = [{"targets": [target]}]
    shutil.copy(GRAFANA / "alerts.yml", directory / "alerts.yml")
    path = directory / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    return path


# ------------------------------------------------------------------ workload


def run_workload(stack: Stack) -> None:
    """12 agents × 2 turns on 4 threads (half streaming), 3 admin evictions to disk and a
    third turn for those sessions (disk restores or recomputes), and one invalid request (a 400)."""

    def client(session: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{stack.api}/v1",
            api_key="unused",
            default_headers={"X-Session-Id": session},
            max_retries=0,
            timeout=60,
        )

    def turn(c: openai.OpenAI, messages: list[dict[str, str]], stream: bool) -> str:
        kw: dict[str, Any] = dict(
            model=stack.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0
        )
        if not stream:
            return c.chat.completions.create(**kw).choices[0].message.content or ""
        chunks = c.chat.completions.create(stream=True, **kw)
        return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)

    conversations: dict[str, list[dict[str, str]]] = {}

    def agent(i: int, turns: int) -> int:
        session = f"agent-{i}"
        c = client(session)
        messages = conversations.setdefault(
            session,
            [
                {"role": "system", "content": f"You are coding agent {i}. Answer briefly."},
                {"role": "user", "content": f"Task {i}: list the files in src/ and fix the build."},
            ],
        )
        for t in range(turns):
            reply = turn(c, messages, stream=(i + t) % 2 == 1)
            messages += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": f"Tool result {t}: exit status 0, 3 files."},
            ]
        return turns

    with cf.ThreadPoolExecutor(THREADS) as pool:
        stack.completed += sum(pool.map(lambda i: agent(i, TURNS), range(SESSIONS)))

    admin = httpx.Client(
        base_url=stack.api, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30
    )
    with admin:
        listing = admin.get("/admin/sessions", params={"tenant": TENANT}).raise_for_status()
        in_memory = [
            s["session_id"] for s in listing.json()["data"] if s["tier"] in ("device", "ram")
        ]
        if len(in_memory) < EVICTIONS:
            stack.fail(f"expected {EVICTIONS} sessions in device/RAM to evict: {listing.json()}")
        for session in in_memory[:EVICTIONS]:
            r = admin.post(f"/admin/sessions/{TENANT}/{session}/evict", json={"to": "disk"})
            if r.status_code != 200 or r.json()["tier"] != "disk":
                stack.fail(f"evict {session} to disk: HTTP {r.status_code} {r.text}")
            stack.evicted.append(session)
    # resume the evicted sessions: their KV comes back from disk
    with cf.ThreadPoolExecutor(THREADS) as pool:
        indexes = [int(s.removeprefix("agent-")) for s in stack.evicted]
        stack.completed += sum(pool.map(lambda i: agent(i, 1), indexes))

    # one invalid request: the SDK raises on the 400
    with pytest.raises(openai.BadRequestError):
        client("agent-bad").chat.completions.create(model=stack.model, messages=[], max_tokens=4)


# ------------------------------------------------------------------ the stack


@pytest.fixture(scope="module")
def stack(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    assert PROMETHEUS is not None
    tmp = tmp_path_factory.mktemp("prometheus-it")
    port = prom_port = free_port()
    while prom_port == port:
        prom_port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DS4POOL_")}
    env.update(DS4POOL_CACHE=str(demo_dir.parent), PYTHONUNBUFFERED="1")
    server = start(
        "ds4pool",
        [
            sys.executable,
            "-m",
            "ds4pool",
            "serve",
            "--model",
            str(demo_dir),
            "--port",
            str(port),
            "--kv-device-gb",
            "0.002",
            "--kv-ram-gb",
            "0.0005",
            "--kv-disk-dir",
            str(tmp / "sessions"),
            "--kv-persist-idle-s",
            "0.5",
            "--admin-token",
            ADMIN_TOKEN,
        ],
        tmp / "ds4pool.log",
        env=env,
        cwd=ROOT,
    )
    instance = f"127.0.0.1:{port}"
    config = prometheus_config(tmp, instance)
    prometheus = start(
        "prometheus",
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
            "--log.level=info",
        ],
        tmp / "prometheus.log",
        cwd=tmp,
    )
    s = Stack(
        server,
        prometheus,
        f"http://127.0.0.1:{port}",
        f"http://127.0.0.1:{prom_port}",
        instance,
        prom_started=time.time(),
    )
    try:

        def up(proc: Proc, url: str) -> bool:
            if proc.popen.poll() is not None:
                pytest.fail(
                    f"{proc.name} exited with {proc.popen.returncode}" + s.logs(), pytrace=False
                )
            return httpx.get(url, timeout=2).status_code == 200

        wait_for("ds4pool /ready", lambda: up(server, f"{s.api}/ready"), s.logs, START_TIMEOUT_S)
        wait_for(
            "Prometheus /-/ready",
            lambda: up(prometheus, f"{s.prom}/-/ready"),
            s.logs,
            START_TIMEOUT_S,
        )
        wait_for(
            "Prometheus's first successful scrape of ds4pool",
            lambda: s.value(f'up{{job="ds4pool", instance="{instance}"}}') == 1,
            s.logs,
            START_TIMEOUT_S,
        )
        s.model = httpx.get(f"{s.api}/v1/models", timeout=10).json()["data"][0]["id"]

        run_workload(s)
        done = time.time()

        def scraped_since_workload() -> bool:
            now = time.time()
            window = f"{max(1, int((now - done) * 1000))}ms"
            n = s.query(f'count_over_time(up{{job="ds4pool"}}[{window}])', at=now)
            result = n["data"]["result"]
            return bool(result) and float(result[0]["value"][1]) >= SCRAPES_AFTER_WORKLOAD

        wait_for(
            f"{SCRAPES_AFTER_WORKLOAD} scrapes after the workload",
            scraped_since_workload,
            s.logs,
            10 * SCRAPES_AFTER_WORKLOAD * SCRAPE_S,
        )
        if s.value(f'up{{job="ds4pool", instance="{instance}"}}') != 1:
            s.fail("the last scrape of ds4pool failed")
        yield s
    finally:
        prometheus.stop()
        server.stop()


# ------------------------------------------------------------------ expressions


def dashboard_targets() -> list[tuple[str, str]]:
    """(panel title, expr) of every target, panels inside collapsed rows included."""
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    out = []
    for panel in dashboard["panels"]:
        for p in [panel, *panel.get("panels", [])]:
            out += [(p["title"], t["expr"]) for t in p.get("targets", []) if t.get("expr")]
    return out


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load((GRAFANA / "alerts.yml").read_text(encoding="utf-8"))["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def grafana_variables(stack: Stack) -> dict[str, str]:
    """What Grafana would put in a query: the instance as a multi-value regex (escaped for a
    PromQL string), and a rate interval that spans the whole test, so every rate() sees all
    of the workload however slow the machine (Grafana: max(4 × scrape, step + scrape))."""
    escaped = re.escape(stack.instance).replace("\\", "\\\\")
    span = max(60, math.ceil(time.time() - stack.prom_started) + 10)
    return {
        "instance": f"({escaped})",
        "__rate_interval": f"{span}s",
        "__interval": f"{SCRAPE_S}s",
        "__range": f"{span}s",
    }


def substitute(expr: str, variables: dict[str, str]) -> str:
    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in variables:
            raise AssertionError(f"unknown Grafana variable ${name} in {expr}: add it above")
        return variables[name]

    return VARIABLE_RE.sub(repl, expr)


def finite(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(r["value"][1])) for r in result)


def test_every_dashboard_query_returns_data(stack: Stack) -> None:
    targets = dashboard_targets()
    assert len(targets) >= 40, f"only {len(targets)} dashboard queries found"
    variables = grafana_variables(stack)
    problems = []
    for title, raw in targets:
        expr = substitute(raw, variables)
        answer = stack.query(expr)
        if answer.get("status") != "success":
            problems.append(f"[{title}] does not run: {answer.get('error')}\n    {expr}")
            continue
        result = answer["data"]["result"]
        if not result:
            problems.append(f"[{title}] returned no series\n    {expr}")
        elif title not in DASHBOARD_NO_FINITE_VALUE and not finite(result):
            problems.append(f"[{title}] returned only NaN/Inf: {result}\n    {expr}")
    if problems:
        stack.fail(
            f"{len(problems)} of {len(targets)} dashboard queries failed:\n" + "\n".join(problems)
        )


def test_instance_variable_lists_the_target(stack: Stack) -> None:
    """label_values(ds4pool_build_info, instance): what Grafana asks Prometheus for it."""
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    [var] = [v for v in dashboard["templating"]["list"] if v["name"] == "instance"]
    query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
    m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query.strip())
    assert m, f"unexpected variable query {query!r}"
    r = httpx.get(
        f"{stack.prom}/api/v1/label/{m.group(2)}/values", params={"match[]": m.group(1)}, timeout=10
    )
    if r.json() != {"status": "success", "data": [stack.instance]}:
        stack.fail(f"label_values: expected [{stack.instance}], got {r.text}")


def test_every_alert_expression_runs_and_is_quiet(stack: Stack) -> None:
    rules = alert_rules()
    assert len(rules) >= 5
    problems = []
    for rule in rules:
        name, expr = rule["alert"], rule["expr"].strip()
        answer = stack.query(expr)
        if answer.get("status") != "success":
            problems.append(f"[{name}] does not run: {answer.get('error')}\n    {expr}")
            continue
        if name in ALERT_PARSE_ONLY:
            continue
        if answer["data"]["result"]:
            problems.append(
                f"[{name}] is true for a healthy workload: {answer['data']['result']}\n    {expr}"
            )
        m = COMPARISON_RE.match(expr)
        if m is None:
            problems.append(f"[{name}] has no trailing threshold to strip\n    {expr}")
            continue
        result = stack.vector(m.group("expr"))
        if not result or not finite(result):
            problems.append(
                f"[{name}] without its threshold returns no value: {result}\n    {m.group('expr')}"
            )
    if problems:
        stack.fail(f"{len(problems)} alert expression problems:\n" + "\n".join(problems))


def test_alert_rules_are_loaded_and_evaluated(stack: Stack) -> None:
    expected = {r["alert"] for r in alert_rules()}

    def rules() -> list[dict[str, Any]]:
        r = httpx.get(f"{stack.prom}/api/v1/rules", params={"type": "alert"}, timeout=10)
        return [rule for g in r.json()["data"]["groups"] for rule in g["rules"]]

    wait_for(
        "every alert rule to be evaluated",
        lambda: all(r["health"] != "unknown" for r in rules()),
        stack.logs,
        10 * SCRAPE_S,
    )
    loaded = rules()
    if {r["name"] for r in loaded} != expected:
        stack.fail(f"Prometheus loaded {[r['name'] for r in loaded]}, expected {expected}")
    bad = [
        (r["name"], r["health"], r.get("lastError"), r["state"])
        for r in loaded
        if r["health"] != "ok" or r["state"] != "inactive"
    ]
    if bad:
        stack.fail(f"alert rules not ok and inactive (name, health, error, state): {bad}")


def test_the_workload_shows_up_in_prometheus(stack: Stack) -> None:
    """The counters Prometheus stored match what the workload did."""
    i = f'instance="{stack.instance}"'
    checks = {
        "completed requests": (
            stack.value(f'sum(ds4pool_requests_total{{{i}, status=~"stop|length"}})'),
            lambda v: v == stack.completed,
        ),
        "invalid requests": (
            stack.value(f'sum(ds4pool_requests_total{{{i}, status="invalid"}})'),
            lambda v: v == 1,
        ),
        "TTFT observations": (
            stack.value(f"sum(ds4pool_time_to_first_token_seconds_count{{{i}}})"),
            lambda v: v == stack.completed,
        ),
        "prefix-hit tokens": (
            stack.value(f"sum(ds4pool_prefix_hit_tokens_total{{{i}}})"),
            lambda v: v > 0,
        ),
        "generated tokens": (
            stack.value(f"sum(ds4pool_generation_tokens_total{{{i}}})"),
            lambda v: 0 < v <= stack.completed * MAX_TOKENS,
        ),
        "admin moves": (
            stack.value(f'sum(ds4pool_session_moves_total{{{i}, reason="admin", to="disk"}})'),
            lambda v: v == EVICTIONS,
        ),
        # each evicted session came back: its KV read from disk, or recomputed when that
        # was cheaper (kv/cost.py: the demo model prefills its short prompts faster than a
        # snapshot read); every one of them was decided
        "disk restores or recomputes": (
            stack.value(
                f'sum(ds4pool_restore_duration_seconds_count{{{i}, tier="disk"}}) + '
                f'sum(ds4pool_restore_decisions_total{{{i}, tier="disk", choice="recompute"}})'
            ),
            lambda v: v >= EVICTIONS,
        ),
        "disk decisions": (
            stack.value(f'sum(ds4pool_restore_decisions_total{{{i}, tier="disk"}})'),
            lambda v: v >= EVICTIONS,
        ),
        "pressure moves": (
            stack.value(f'sum(ds4pool_session_moves_total{{{i}, reason="pressure"}})'),
            lambda v: v > 0,
        ),
        "snapshot errors": (
            stack.value(f"sum(ds4pool_snapshot_errors_total{{{i}}})"),
            lambda v: v == 0,
        ),
        "sessions in some tier": (
            stack.value(f"sum(ds4pool_sessions{{{i}}})"),
            lambda v: v == SESSIONS,
        ),
    }
    wrong = {name: value for name, (value, ok) in checks.items() if not ok(value)}
    if wrong:
        stack.fail(
            f"unexpected values (completed={stack.completed}): {wrong}\n"
            f"all: { {n: v for n, (v, _) in checks.items()} }"
        )
