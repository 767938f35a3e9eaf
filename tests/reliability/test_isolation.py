"""Tenant isolation under attack: two API keys (tenants A and B) and an admin token.

Tenant A holds sessions whose conversation contains a secret, in every tier (device, RAM,
disk, and on disk across a restart). Tenant B guesses A's session ids and continues them,
lists and deletes sessions, calls /admin with its key, tries variants of A's key and of the
admin token, empty and whitespace keys, and keys in the wrong header. Every attempt must
fail: a 401/404 (or a fresh session of B's own: cached_tokens == 0 and the completion equal to
what a fresh session gives for the same prompt), A's sessions unchanged, nothing of A's in
any answer. Blocks are shared within a tenant, so before each of B's requests B drops its
sessions and the blocks nobody holds are evicted (B's own earlier requests of the same
prompts would be reused otherwise): anything cached then could only be a block A's sessions
hold. Positive controls show that each check would see a leak (A itself does reuse its
sessions; the admin does reach them).
"""

from __future__ import annotations

import base64
import json
import random
import re
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import httpx
import pytest

from ds4pool.api.config import TenantConfig
from tests.reliability.helpers import (
    InProcessServer,
    cached_tokens,
    http_client,
    report,
    size,
    start_in_process,
)

pytestmark = pytest.mark.timeout(size(300, 1200))

rng = random.Random(99)
KEY_A = "sk-a-" + "".join(rng.choice("0123456789abcdef") for _ in range(32))
KEY_B = "sk-b-" + "".join(rng.choice("0123456789abcdef") for _ in range(32))
ADMIN = "adm-" + "".join(rng.choice("0123456789abcdef") for _ in range(32))
KEYS = {KEY_A: TenantConfig("tenant-a"), KEY_B: TenantConfig("tenant-b")}
SECRET = "the launch code is 7391-ALPHA-ZULU"
A_SESSIONS = ["proj-1", "agent-7", "shared", "on-disk", "in-ram"]
MAX_TOKENS = 8


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def convo(turn: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": f"You are A's agent. Never reveal: {SECRET}."}]
    for t in range(turn):
        msgs += [
            {"role": "user", "content": f"step {t}: what is the code?"},
            {"role": "assistant", "content": f"(reply {t}) I cannot say."},
        ]
    return [*msgs, {"role": "user", "content": f"step {turn}: tell me the code now"}]


def chat_body(turn: int) -> dict:
    return {"messages": convo(turn), "max_tokens": MAX_TOKENS, "temperature": 0}


class Attack:
    def __init__(self, srv: InProcessServer) -> None:
        self.srv = srv
        self.c = http_client(srv.url, 120)
        self.attempts: Counter[str] = Counter()
        self.successes: list[str] = []
        self._fresh: dict[str, str] = {}

    def a_state(self) -> dict:
        """A's sessions as far as B could change them (not the tier nor the persisted count:
        memory pressure from B's own sessions may legitimately move A's KV down the tiers)."""
        infos = self.srv.engine.pool.list_sessions(tenant="tenant-a")
        keep = ("num_tokens", "num_computed", "hits", "pinned", "created", "last_used")
        return {i.session_id: {k: asdict(i)[k] for k in keep} for i in infos}

    def fresh(self, body: dict) -> str:
        """B's completion for `body` in an ephemeral session: what a fresh session gives."""
        key = json.dumps(body, sort_keys=True)
        if key not in self._fresh:
            self.forget(None)
            r = self.c.post("/v1/chat/completions", json=body, headers=bearer(KEY_B))
            assert r.status_code == 200, r.text
            assert cached_tokens(r.json()) == 0
            self._fresh[key] = r.json()["choices"][0]["message"]["content"]
        return self._fresh[key]

    def expect(self, kind: str, ok: bool, what: str) -> None:
        self.attempts[kind] += 1
        if not ok:
            self.successes.append(f"{kind}: {what}")

    def leaks(self, text: str) -> bool:
        return SECRET in text or '"tenant-a"' in text or any(f'"{s}"' in text for s in A_SESSIONS)

    def forget(self, sid: str | None) -> None:
        """B drops its own sessions (`sid` and every other: B's sessions share blocks with
        each other) and the blocks nobody holds are evicted, so that anything cached on B's
        next request under `sid` could only have come from A."""
        r = self.c.get("/v1/sessions", headers=bearer(KEY_B))
        assert r.status_code == 200, r.text
        for own in {*([sid] if sid else []), *(s["session_id"] for s in r.json()["data"])}:
            r = self.c.delete(f"/v1/sessions/{own}", headers=bearer(KEY_B))
            assert r.status_code in (200, 404), r.text
        self.srv.engine.pool.drop_cached_blocks()

    # ------------------------------------------------------------------ the attacks

    def continue_as_b(self, sid: str, turn: int, headers: dict[str, str] | None = None) -> None:
        """B sends A's own next prompt under A's session id: a fresh session of B's."""
        body = chat_body(turn)
        expected = self.fresh(body)
        self.forget(sid)
        before = self.a_state()
        r = self.c.post(
            "/v1/chat/completions",
            json=body,
            headers={**(headers or bearer(KEY_B)), "X-Session-Id": sid},
        )
        ok = r.status_code == 200 and cached_tokens(r.json()) == 0
        ok = ok and r.json()["choices"][0]["message"]["content"] == expected
        self.expect(
            "continue A's session id", ok and self.a_state() == before, f"{sid}: {r.text[:200]}"
        )

    def continue_other_apis(self, sid: str) -> None:
        before = self.a_state()
        # legacy completions with A's rendered prompt text
        prompt = self.srv.engine.tokenizer.apply_chat_template(convo(1), add_generation_prompt=True)
        self.forget(sid)
        r = self.c.post(
            "/v1/completions",
            json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0},
            headers={**bearer(KEY_B), "X-Session-Id": sid},
        )
        self.expect(
            "continue via /v1/completions",
            r.status_code == 200 and cached_tokens(r.json()) == 0,
            r.text[:200],
        )
        # Anthropic messages, key in x-api-key
        self.forget(sid)
        r = self.c.post(
            "/v1/messages",
            json={"model": "m", "max_tokens": MAX_TOKENS, "system": convo(0)[0]["content"],
                  "messages": [{"role": "user", "content": "step 0: what is the code?"}]},
            headers={"x-api-key": KEY_B, "X-Session-Id": sid},
        )  # fmt: skip
        ok = r.status_code == 200 and r.json()["usage"].get("cache_read_input_tokens", 0) == 0
        self.expect("continue via /v1/messages", ok, r.text[:200])
        # streaming
        self.forget(sid)
        with self.c.stream(
            "POST",
            "/v1/chat/completions",
            json={**chat_body(1), "stream": True, "stream_options": {"include_usage": True}},
            headers={**bearer(KEY_B), "X-Session-Id": sid},
        ) as s:
            lines = [ln for ln in s.iter_lines() if ln.startswith("data: {")]
        usage = [json.loads(ln[6:]).get("usage") for ln in lines]
        cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usage if u]
        self.expect("continue via streaming", s.status_code == 200 and cached == [0], str(cached))
        self.expect("A unchanged by other APIs", self.a_state() == before, sid)

    def listings(self) -> None:
        for path in ("/v1/sessions", "/v1/sessions?tenant=tenant-a", "/v1/sessions?all=true"):
            for headers in (
                bearer(KEY_B),
                {"x-api-key": KEY_B},
                {**bearer(KEY_B), "X-Tenant": "tenant-a"},
            ):
                r = self.c.get(path, headers=headers)
                data = r.json().get("data", []) if r.status_code == 200 else []
                # B's own sessions may carry A's ids (B made them): tenants must all be B's
                ok = r.status_code == 200 and all(s["tenant"] == "tenant-b" for s in data)
                self.expect("list sessions", ok and SECRET not in r.text, f"{path}: {r.text[:200]}")

    def deletions(self, sids: list[str]) -> None:
        before = self.a_state()
        for sid in sids:
            r = self.c.delete(f"/v1/sessions/{sid}", headers=bearer(KEY_B))
            # 404, or 200 for B's own session of that name: A's must not change
            self.expect("delete A's session via /v1", r.status_code in (200, 404), r.text[:200])
        self.expect("A unchanged by deletes", self.a_state() == before, str(before.keys()))

    def admin_with(self, headers: dict[str, str], kind: str) -> None:
        before = self.a_state()
        calls: list[tuple[str, str, dict | None]] = [
            ("GET", "/admin/sessions", None),
            ("GET", "/admin/sessions?tenant=tenant-a", None),
            ("GET", "/admin/sessions/tenant-a/proj-1", None),
            ("POST", "/admin/sessions/tenant-a/proj-1/evict", {"to": "disk"}),
            ("POST", "/admin/sessions/tenant-a/agent-7/pin", None),
            ("POST", "/admin/sessions/tenant-a/agent-7/unpin", None),
            ("DELETE", "/admin/sessions/tenant-a/shared", None),
            ("GET", "/admin/pool", None),
            ("POST", "/admin/flush", None),
        ]
        for method, path, body in calls:
            r = self.c.request(method, path, headers=headers, json=body)
            ok = r.status_code in (401, 403) and not self.leaks(r.text)
            self.expect(kind, ok, f"{method} {path} → {r.status_code} {r.text[:120]}")
        self.expect(f"{kind}: A unchanged", self.a_state() == before, "")

    def bad_keys(self) -> list[tuple[str, dict]]:
        """Variants of A's key and of the admin token, empty keys, keys in wrong headers."""
        out: list[tuple[str, dict[str, str]]] = []
        for name, secret in (("A's key", KEY_A), ("admin token", ADMIN)):
            variants = {
                "prefix": secret[:-1],
                "half": secret[: len(secret) // 2],
                "suffix": secret + "0",
                "drop first": secret[1:],
                "upper": secret.upper(),
                "doubled": secret + secret,
                "confusable": secret.replace("a", "\u0430", 1),
                "comma list": f"{KEY_B},{secret}",
            }
            for v, key in variants.items():
                out.append((f"{name} {v} as bearer", {"Authorization": f"Bearer {key}"}))
                out.append((f"{name} {v} as x-api-key", {"x-api-key": key}))
            out += [
                (f"{name} without scheme", {"Authorization": secret}),
                (f"{name} as Basic", {"Authorization": "Basic " + b64(f"{secret}:")}),
                (f"{name} as Token", {"Authorization": f"Token {secret}"}),
                (f"{name} in Proxy-Authorization", {"Proxy-Authorization": f"Bearer {secret}"}),
                (f"{name} in Api-Key", {"Api-Key": secret}),
                (f"{name} in X-Auth-Token", {"X-Auth-Token": secret}),
                (f"{name} in Cookie", {"Cookie": f"api_key={secret}"}),
                (f"{name} in X-Session-Id", {"X-Session-Id": secret}),
            ]  # fmt: skip
        for name, value in (
            ("empty bearer", "Bearer "),
            ("bare Bearer", "Bearer"),
            ("whitespace bearer", "Bearer  \t "),
            ("empty", ""),
            ("whitespace", "   "),
        ):
            out.append((name, {"Authorization": value}))
        out += [("empty x-api-key", {"x-api-key": ""}), ("space x-api-key", {"x-api-key": " "})]
        out.append(("no key at all", {}))
        # non-ASCII values go out as their UTF-8 bytes (as a client would send them)
        return [(n, {k: v if v.isascii() else v.encode() for k, v in h.items()}) for n, h in out]

    def with_bad_keys(self) -> None:
        before = self.a_state()
        for name, headers in self.bad_keys():
            for method, path, body in (
                ("POST", "/v1/chat/completions", chat_body(1)),
                ("GET", "/v1/sessions", None),
                ("DELETE", "/v1/sessions/proj-1", None),
                ("GET", "/admin/sessions", None),
                ("POST", "/admin/sessions/tenant-a/proj-1/evict", {"to": "disk"}),
            ):
                hdrs = {**headers}
                if path.startswith("/v1/chat") and "X-Session-Id" not in hdrs:
                    hdrs["X-Session-Id"] = "proj-1"
                status, text = self.send(method, path, hdrs, body)
                ok = status in (401, 403) and not self.leaks(text)
                self.expect("bad or misplaced key", ok, f"{name}: {method} {path} → {status}")
            status, _ = self.send("GET", f"/v1/sessions?api_key={KEY_A}", headers, None)
            self.expect("key in the query string", status == 401, f"{name}: {status}")
        self.expect("A unchanged by bad keys", self.a_state() == before, "")

    def send(self, method: str, path: str, headers: dict, body: dict | None) -> tuple[int, str]:
        try:
            r = self.c.request(method, path, headers=headers, json=body)
            return r.status_code, r.text
        except httpx.LocalProtocolError:  # httpx will not send such a header: a raw socket will
            return self.raw(method, path, headers, body)

    def raw(self, method: str, path: str, headers: dict, body: dict | None) -> tuple[int, str]:
        data = json.dumps(body).encode() if body is not None else b""
        lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: x", b"Connection: close"]
        for k, v in headers.items():
            lines.append(k.encode() + b": " + (v if isinstance(v, bytes) else v.encode()))
        lines += [b"Content-Type: application/json", b"Content-Length: %d" % len(data)]
        port = int(self.srv.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            sock.sendall(b"\r\n".join(lines) + b"\r\n\r\n" + data)
            resp = b""
            while chunk := sock.recv(65536):
                resp += chunk
        m = re.match(rb"HTTP/1\.1 (\d{3}) ", resp)
        return (int(m.group(1)) if m else 0), resp.decode(errors="replace")

    def metrics(self) -> None:
        r = self.c.get("/metrics", headers=bearer(KEY_B))
        leaked = any(x in r.text for x in (*A_SESSIONS, "tenant-a", SECRET))
        self.expect("metrics name A's sessions", not leaked, "")


def setup_a(c: httpx.Client, turns: int = 3) -> None:
    for sid in A_SESSIONS:
        for t in range(turns):
            r = c.post(
                "/v1/chat/completions",
                json=chat_body(t),
                headers={**bearer(KEY_A), "X-Session-Id": sid},
            )
            assert r.status_code == 200, r.text
            if t:
                assert cached_tokens(r.json()) > 0  # positive control: A reuses its session
    admin = bearer(ADMIN)
    assert (
        c.post(
            "/admin/sessions/tenant-a/on-disk/evict", headers=admin, json={"to": "disk"}
        ).status_code
        == 200
    )
    assert (
        c.post(
            "/admin/sessions/tenant-a/in-ram/evict", headers=admin, json={"to": "ram"}
        ).status_code
        == 200
    )
    assert c.post("/admin/sessions/tenant-a/agent-7/pin", headers=admin).status_code == 200


def guessed_ids(n: int) -> list[str]:
    g = random.Random(5)
    common = ["agent-1", "agent-2", "session", "default", "main", "codex-1", "claude", "opencode-1"]
    ids = A_SESSIONS + common + [f"agent-{i}" for i in range(8, 8 + n)]
    ids += ["tenant-a:proj-1", "tenant-a.proj-1", "proj-1.", "PROJ-1", "proj-1:"]
    ids += ["".join(g.choice("0123456789abcdef") for _ in range(32)) for _ in range(3)]
    return ids


def run_attacks(attack: Attack, guesses: list[str]) -> None:
    attack.deletions(A_SESSIONS)  # nothing of B's yet: all 404
    for i, sid in enumerate(guesses):
        attack.continue_as_b(sid, turn=3 if sid in A_SESSIONS else i % 3)
    for sid in A_SESSIONS:
        attack.continue_other_apis(sid)
    attack.listings()
    attack.admin_with(bearer(KEY_B), "/admin with B's key")
    attack.admin_with({"x-api-key": KEY_B}, "/admin with B's key in x-api-key")
    attack.admin_with(bearer(KEY_A), "/admin with A's key")
    attack.with_bad_keys()
    attack.metrics()
    attack.deletions(guesses)  # now B's own sessions of those names: 200, A's untouched


def a_controls(c: httpx.Client, check: Callable[[str], None]) -> None:
    """Positive controls: A itself resumes every session (a leak would be this visible)."""
    for sid in A_SESSIONS:
        r = c.post(
            "/v1/chat/completions",
            json=chat_body(3),
            headers={**bearer(KEY_A), "X-Session-Id": sid},
        )
        check(sid if r.status_code == 200 and cached_tokens(r.json()) > 0 else f"FAILED {sid}")


def test_tenant_b_cannot_reach_tenant_a(loaded, tmp_path: Path) -> None:  # noqa: ANN001
    t0 = time.monotonic()
    engine_kw = {"kv_device_gb": 0.02, "kv_disk_dir": tmp_path / "kv", "kv_persist_idle_s": 0.5}
    server_kw = {"api_keys": KEYS, "admin_token": ADMIN}
    guesses = guessed_ids(size(6, 120))
    controls: list[str] = []

    srv = start_in_process(loaded, engine_kw, **server_kw)
    try:
        with http_client(srv.url, 120) as c:
            setup_a(c)
            tiers = {i.session_id: i.tier for i in srv.engine.pool.list_sessions(tenant="tenant-a")}
            assert tiers["on-disk"] == "disk" and tiers["in-ram"] == "ram", tiers
            attack = Attack(srv)
            run_attacks(attack, guesses)
            a_controls(c, controls.append)
        errors = srv.statuses.errors
    finally:
        srv.close()  # flushes every session to disk

    # Again after a restart: every one of A's sessions now comes back from disk.
    srv = start_in_process(loaded, engine_kw, **server_kw)
    try:
        assert {i.tier for i in srv.engine.pool.list_sessions(tenant="tenant-a")} == {"disk"}
        attack2 = Attack(srv)
        for i, sid in enumerate(guesses):
            attack2.continue_as_b(sid, turn=3 if sid in A_SESSIONS else i % 3)
        attack2.listings()
        attack2.admin_with(bearer(KEY_B), "/admin with B's key")
        with http_client(srv.url, 120) as c:
            a_controls(c, controls.append)
        errors += srv.statuses.errors
        srv.engine.pool.check_integrity()
    finally:
        srv.close()

    attempts = attack.attempts + attack2.attempts
    successes = attack.successes + attack2.successes
    report(
        "isolation",
        attempts=sum(attempts.values()),
        attempts_by_kind=dict(attempts),
        guessed_session_ids=len(guesses),
        successes=len(successes),
        positive_controls_ok=sum(not c.startswith("FAILED") for c in controls),
        responses_5xx=len(errors),
        seconds=round(time.monotonic() - t0, 1),
    )
    assert not successes, "\n".join(successes[:30])
    assert not [c for c in controls if c.startswith("FAILED")], controls
    assert not errors, errors
