"""`ds4pool sessions ...`: the admin API from the command line (stdlib HTTP only)."""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from ds4pool.errors import Ds4poolError


def add_sessions_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sessions", help="list and manage sessions of a running server (admin)")
    p.add_argument("--url", default=os.environ.get("DS4POOL_URL", "http://127.0.0.1:8000"))
    p.add_argument("--admin-token", default=os.environ.get("DS4POOL_ADMIN_TOKEN"))
    p.add_argument("--json", action="store_true", help="print raw JSON")
    act = p.add_subparsers(dest="action", required=True)
    ls = act.add_parser("list", help="sessions of all tenants")
    ls.add_argument("--tenant")
    ls.add_argument("--tier", choices=["device", "ram", "disk", "none"])
    ls.add_argument("--limit", type=int, default=100)
    ls.add_argument("--offset", type=int, default=0)
    for name in ("show", "drop", "pin", "unpin"):
        one = act.add_parser(name)
        one.add_argument("tenant")
        one.add_argument("session_id")
    ev = act.add_parser("evict", help="move a session to RAM or disk")
    ev.add_argument("tenant")
    ev.add_argument("session_id")
    ev.add_argument("--to", choices=["ram", "disk"], default="ram")
    pp = act.add_parser("pin-prefix", help="pin a system prompt for a tenant's sessions to share")
    pp.add_argument("--tenant", default="default")
    src = pp.add_mutually_exclusive_group(required=True)
    src.add_argument("--system", help="system prompt text (rendered by the chat template)")
    src.add_argument("--system-file", type=argparse.FileType("r"), help="... read from a file")
    src.add_argument("--text-file", type=argparse.FileType("r"), help="raw prompt text")
    act.add_parser("prefixes", help="pinned prefixes")
    up = act.add_parser("unpin-prefix", help="let a pinned prefix be evicted again")
    up.add_argument("prefix_id")
    act.add_parser("flush", help="persist every changed session to disk")
    act.add_parser("pool", help="usage per tier, queue depth")
    p.set_defaults(func=run_sessions)


def _call(args: argparse.Namespace, method: str, path: str, body: Any = None) -> Any:
    url = args.url.rstrip("/") + path
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if args.admin_token:
        req.add_header("Authorization", f"Bearer {args.admin_token}")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        raise Ds4poolError(f"{method} {path}: HTTP {exc.code}: {message}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise Ds4poolError(f"cannot reach {args.url}: {exc}") from None


def _key(args: argparse.Namespace) -> str:
    quote = urllib.parse.quote
    return f"/admin/sessions/{quote(args.tenant, safe='')}/{quote(args.session_id, safe='')}"


def _prefix_body(args: argparse.Namespace) -> dict[str, Any]:
    if args.text_file is not None:
        return {"tenant": args.tenant, "text": args.text_file.read()}
    system = args.system if args.system is not None else args.system_file.read()
    return {"tenant": args.tenant, "messages": [{"role": "system", "content": system}]}


def run_sessions(args: argparse.Namespace) -> int:
    a = args.action
    if a == "list":
        query = {
            k: v
            for k in ("tenant", "tier", "limit", "offset")
            if (v := getattr(args, k)) is not None
        }
        out = _call(args, "GET", "/admin/sessions?" + urllib.parse.urlencode(query))
    elif a == "show":
        out = _call(args, "GET", _key(args))
    elif a == "evict":
        out = _call(args, "POST", _key(args) + "/evict", {"to": args.to})
    elif a == "drop":
        out = _call(args, "DELETE", _key(args))
    elif a in ("pin", "unpin"):
        out = _call(args, "POST", f"{_key(args)}/{a}")
    elif a == "pin-prefix":
        out = _call(args, "POST", "/admin/prefixes", _prefix_body(args))
    elif a == "prefixes":
        out = _call(args, "GET", "/admin/prefixes")
    elif a == "unpin-prefix":
        prefix_id = urllib.parse.quote(args.prefix_id, safe="")
        out = _call(args, "DELETE", f"/admin/prefixes/{prefix_id}")
    elif a == "flush":
        out = _call(args, "POST", "/admin/flush")
    else:
        out = _call(args, "GET", "/admin/pool")
    if args.json or a != "list":
        print(json.dumps(out, indent=2))
        return 0
    print(f"{'TENANT':<16} {'SESSION':<32} {'TIER':<7} {'TOKENS':>8} {'KV MB':>8} {'HITS':>5}")
    for s in out["data"]:
        print(
            f"{s['tenant']:<16} {s['session_id']:<32} {s['tier']:<7} {s['num_tokens']:>8} "
            f"{s['kv_bytes'] / 1e6:>8.2f} {s['hits']:>5}"
        )
    print(f"({len(out['data'])} of {out['total']})")
    return 0
