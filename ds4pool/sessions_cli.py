"""`ds4pool sessions ...`: the admin API from the command line (stdlib HTTP only).

`--url` repeated (or DS4POOL_URL comma-separated) addresses several replicas: `list` merges
their sessions with a REPLICA column, other actions run on each and print one result per
replica. `store --kv-disk-dir DIR` lists the snapshots of a shared store directly (headers
and leases only; it needs the directory mounted, not a server)."""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from ds4pool.errors import Ds4poolError


def add_sessions_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sessions", help="list and manage sessions of a running server (admin)")
    p.add_argument(
        "--url",
        action="append",
        help="a server's base URL; repeat for every replica (default: $DS4POOL_URL, "
        "comma-separated, or http://127.0.0.1:8000)",
    )
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
    st = act.add_parser("store", help="snapshots in a shared store directory, with leases")
    st.add_argument("--kv-disk-dir", required=True, help="the store directory (mounted here)")
    st.add_argument("--tenant")
    p.set_defaults(func=run_sessions)


def urls(args: argparse.Namespace) -> list[str]:
    if args.url:
        return list(args.url)
    env = os.environ.get("DS4POOL_URL", "")
    return [u for u in env.split(",") if u] or ["http://127.0.0.1:8000"]


def _call(args: argparse.Namespace, method: str, path: str, body: Any = None) -> Any:
    url = args.base.rstrip("/") + path
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
        raise Ds4poolError(f"cannot reach {args.base}: {exc}") from None


def _key(args: argparse.Namespace) -> str:
    quote = urllib.parse.quote
    return f"/admin/sessions/{quote(args.tenant, safe='')}/{quote(args.session_id, safe='')}"


def _prefix_body(args: argparse.Namespace) -> dict[str, Any]:
    if args.text_file is not None:
        return {"tenant": args.tenant, "text": args.text_file.read()}
    system = args.system if args.system is not None else args.system_file.read()
    return {"tenant": args.tenant, "messages": [{"role": "system", "content": system}]}


def run_sessions(args: argparse.Namespace) -> int:
    if args.action == "store":
        return _store(args)
    bases = urls(args)
    if len(bases) == 1:
        args.base = bases[0]
        return _one(args)
    if args.action == "list":
        return _list_all(args, bases)
    results = {}
    for base in bases:
        args.base = base
        results[base] = _action(args)
    print(json.dumps(results, indent=2))
    return 0


def _one(args: argparse.Namespace) -> int:
    out = _action(args)
    if args.json or args.action != "list":
        print(json.dumps(out, indent=2))
        return 0
    _print_sessions([(None, s) for s in out["data"]])
    print(f"({len(out['data'])} of {out['total']})")
    return 0


def _list_all(args: argparse.Namespace, bases: list[str]) -> int:
    rows: list[tuple[str | None, dict[str, Any]]] = []
    total = 0
    for base in bases:
        args.base = base
        out = _action(args)
        rows += [(base, s) for s in out["data"]]
        total += out["total"]
    if args.json:
        print(json.dumps([{"replica": b, **s} for b, s in rows], indent=2))
        return 0
    _print_sessions(rows)
    print(f"({len(rows)} of {total} on {len(bases)} replicas)")
    return 0


def _print_sessions(rows: list[tuple[str | None, dict[str, Any]]]) -> None:
    head = f"{'REPLICA':<28} " if rows and rows[0][0] is not None else ""
    print(
        f"{head}{'TENANT':<16} {'SESSION':<32} {'TIER':<7} {'TOKENS':>8} {'KV MB':>8} {'HITS':>5}"
    )
    for base, s in rows:
        lead = f"{base:<28} " if base is not None else ""
        print(
            f"{lead}{s['tenant']:<16} {s['session_id']:<32} {s['tier']:<7} "
            f"{s['num_tokens']:>8} {s['kv_bytes'] / 1e6:>8.2f} {s['hits']:>5}"
        )


def _store(args: argparse.Namespace) -> int:
    from ds4pool.kv.store import list_store

    try:
        entries = list_store(args.kv_disk_dir)
    except OSError as exc:
        raise Ds4poolError(f"--kv-disk-dir: {exc}") from None
    if args.tenant is not None:
        entries = [e for e in entries if e.tenant == args.tenant]
    if args.json:
        print(json.dumps([e.to_json() for e in entries], indent=2))
        return 0
    print(f"{'TENANT':<16} {'SESSION':<32} {'TOKENS':>8} {'MB':>8} {'LEASE':<16} MODIFIED")
    for e in entries:
        lease = f"{e.holder or '-'}{' (live)' if e.lease_live else ''}"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.modified))
        print(
            f"{e.tenant:<16} {e.session_id:<32} {e.num_tokens:>8} {e.num_bytes / 1e6:>8.2f} "
            f"{lease:<16} {when}"
        )
    print(f"({len(entries)} snapshots in {args.kv_disk_dir})")
    return 0


def _action(args: argparse.Namespace) -> Any:
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
    return out
