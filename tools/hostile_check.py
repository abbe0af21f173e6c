"""Hostile-input and fault run against a local memra server; prints its figures and fails on regression.

Phases (each bounded; loopback only): warm-up, idle RSS; oversized prompts (a 3 MB ``"hello " * 500000``
completion prompt, plus prompts just under the byte bound that tokenise past the context); slow
connections (sockets that announce a 3 MB body and send 13 bytes) while /health, /ready and /metrics
are timed, then how long the server takes to drop them; HTTP-layer errors (bad or huge
Content-Length, huge headers) that must be JSON; an overload burst that must get 429 + Retry-After;
mixed load (tools/loadgen.py --mix mixed, client disconnects); then leaked KV blocks (/admin/kv) and
RSS again. The server's RSS is read from /proc/PID/status (``--pid``; same machine).

    python tools/hostile_check.py --url http://127.0.0.1:8000 --pid $(pgrep -f 'memra serve') \\
        --api-key sk-... --oversized 1000 --slow 1000 --load 10000 --concurrency 64

Exit 1 when any check fails: a 5xx, a non-JSON error, a leaked block, RSS after the oversized
prompts more than ``--max-rss-growth-mb`` above idle, a health probe slower than ``--max-health-ms``
under slow connections, slow connections kept past ``--max-slow-close-s``, or no 429 in the burst.
Must not import the engine.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loadgen  # noqa: E402


class Client:
    def __init__(self, host: str, port: int, api_key: str | None, timeout: float = 60.0):
        self.host, self.port, self.key, self.timeout = host, port, api_key, timeout
        self.status: dict[str, int] = {}
        self.not_json: list[str] = []
        self.lock = threading.Lock()

    def _count(self, status: int) -> None:
        with self.lock:
            self.status[str(status)] = self.status.get(str(status), 0) + 1

    def request(self, method: str, path: str, body: dict | bytes | None = None, timeout: float | None = None):
        """(status, headers dict, parsed JSON or raw bytes, seconds)."""
        headers = {"Content-Type": "application/json"}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        raw = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        t0 = time.monotonic()
        c = http.client.HTTPConnection(self.host, self.port, timeout=timeout or self.timeout)
        try:
            c.request(method, path, body=raw, headers=headers)
            r = c.getresponse()
            data = r.read()
            dt = time.monotonic() - t0
            hdrs = {k.lower(): v for k, v in r.getheaders()}
        finally:
            c.close()
        self._count(r.status)
        parsed: object = data
        if hdrs.get("content-type", "").startswith("application/json"):
            parsed = json.loads(data)
        elif r.status >= 400:
            with self.lock:
                self.not_json.append(f"{method} {path} -> {r.status} {hdrs.get('content-type')}")
        return r.status, hdrs, parsed, dt

    def raw(self, data: bytes, timeout: float = 10.0, first: int = 0) -> tuple[int, dict, bytes]:
        """Send raw bytes on a fresh socket (``first`` bytes, a pause, the rest: so the server has read
        everything when it answers and its close is not a reset); parse status, headers and body."""
        with socket.create_connection((self.host, self.port), timeout=timeout) as s:
            if first:
                s.sendall(data[:first])
                time.sleep(0.2)
                data = data[first:]
            s.sendall(data)
            buf = b""
            while True:
                try:
                    chunk = s.recv(65536)
                except OSError:
                    break
                if not chunk:
                    break
                buf += chunk
        head, _, body = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1]) if lines and len(lines[0].split()) > 1 else 0
        hdrs = {}
        for ln in lines[1:]:
            k, _, v = ln.partition(":")
            hdrs[k.strip().lower()] = v.strip()
        self._count(status)
        if status >= 400 and not hdrs.get("content-type", "").startswith("application/json"):
            with self.lock:
                self.not_json.append(f"raw {data[:40]!r} -> {status} {hdrs.get('content-type')}")
        return status, hdrs, body


def rss_mb(pid: int | None) -> float | None:
    if not pid:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))] if s else 0.0


def phase_oversized(c: Client, n: int, context: int, byte_limit: int) -> dict:
    huge = {"prompt": "hello " * 500000, "max_tokens": 1}
    near = {"prompt": "hello " * max(1, (byte_limit - 64) // 6), "max_tokens": 1}  # tokenised, > context
    codes: dict[str, int] = {}
    for i in range(n):
        st, _, body, _ = c.request("POST", "/v1/completions", huge if i % 2 == 0 else near)
        code = body.get("error", {}).get("code") if isinstance(body, dict) else None
        codes[f"{st}_{code}"] = codes.get(f"{st}_{code}", 0) + 1
    return codes


def phase_slow(c: Client, n: int, probes: int, max_wait_s: float) -> dict:
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < n + 256 <= hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (n + 256, hard))
    except (ImportError, ValueError, OSError):
        pass
    socks: list[socket.socket] = []
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 3000000\r\n\r\n" + b'{"messages":['
    )
    t_open = time.monotonic()
    for _ in range(n):
        s = socket.create_connection((c.host, c.port), timeout=10)
        s.sendall(head)
        socks.append(s)
    time.sleep(0.2)
    lat: dict[str, list[float]] = {"/health": [], "/ready": [], "/metrics": []}
    for _ in range(probes):
        for path in lat:
            st, _, _, dt = c.request("GET", path, timeout=10)
            lat[path].append(dt)
    # how long until the server drops the half-sent requests (answering 408 JSON)
    closed, got_408 = 0, 0
    deadline = time.monotonic() + max_wait_s
    for s in socks:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            data = s.recv(4096)
            while data and b"\r\n\r\n" not in data:
                more = s.recv(4096)
                if not more:
                    break
                data += more
            closed += 1
            got_408 += data.startswith(b"HTTP/1.1 408") and b"application/json" in data
        except OSError:
            pass
    close_s = time.monotonic() - t_open
    for s in socks:
        s.close()
    allp = [x for v in lat.values() for x in v]
    return {
        "slow_connections": n,
        "health_p50_ms": round(pct(allp, 50) * 1000, 1),
        "health_max_ms": round(max(allp) * 1000, 1) if allp else None,
        "per_path_max_ms": {k: round(max(v) * 1000, 1) for k, v in lat.items() if v},
        "slow_closed": closed,
        "slow_answered_408_json": got_408,
        "slow_all_closed_after_s": round(close_s, 2) if closed == n else None,
    }


def phase_http_errors(c: Client) -> dict:
    cases = {
        "bad_content_length": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        "huge_content_length": b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999999\r\n\r\n",
        "huge_headers": b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 262200 + b"\r\n\r\n",
        "bad_request_line": b"NONSENSE\r\n\r\n",
        "unknown_route": b"GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    }
    out = {}
    for name, data in cases.items():
        st, hdrs, body = c.raw(data, first=262000 if name == "huge_headers" else 0)
        ok = hdrs.get("content-type", "").startswith("application/json")
        if ok:
            try:
                ok = "error" in json.loads(body)
            except ValueError:
                ok = False
        out[name] = {"status": st, "json_error": ok}
    return out


def phase_overload(c: Client, burst: int, max_tokens: int) -> dict:
    barrier = threading.Barrier(burst)
    res: list[tuple[int, str | None]] = []
    lock = threading.Lock()

    def one() -> None:
        barrier.wait()
        try:
            st, hdrs, _, _ = c.request(
                "POST",
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "count"}], "max_tokens": max_tokens, "ignore_eos": True},
            )
        except OSError:
            st, hdrs = 0, {}
        with lock:
            res.append((st, hdrs.get("retry-after")))

    ts = [threading.Thread(target=one) for _ in range(burst)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(300)
    n429 = sum(1 for s, _ in res if s == 429)
    return {
        "burst": burst,
        "ok": sum(1 for s, _ in res if s == 200),
        "rejected_429": n429,
        "429_with_retry_after": sum(1 for s, ra in res if s == 429 and ra),
        "other": sum(1 for s, _ in res if s not in (200, 429)),
    }


def kv_after(c: Client, wait_s: float = 15.0) -> dict:
    deadline = time.monotonic() + wait_s
    while True:
        st, _, body, _ = c.request("GET", "/admin/kv")
        if st not in (200, 500) or not isinstance(body, dict):
            return {"status": st}
        used = body.get("kv_blocks_used") or 0
        if (used == 0 and body.get("running") == 0 and body.get("waiting") == 0) or time.monotonic() > deadline:
            return {
                "leaked_blocks": used,
                "invariants_ok": body.get("invariants_ok"),
                "running": body.get("running"),
                "waiting": body.get("waiting"),
            }
        time.sleep(0.2)


def run(args: argparse.Namespace) -> dict:
    host, port = loadgen.check_loopback(args.url)
    c = Client(host, port, args.api_key)
    st, _, models, _ = c.request("GET", "/v1/models")
    if st != 200:
        raise SystemExit(f"hostile_check: GET /v1/models -> {st}; is the server up and the key right?")
    context = int(models["data"][0]["context_length"])
    byte_limit = args.prompt_byte_limit or 16 * context
    for _ in range(3):  # warm-up: first requests allocate lazily
        c.request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    report: dict = {"context_length": context, "rss_idle_mb": rss_mb(args.pid), "phase_s": {}}
    t = time.monotonic()

    def lap(name: str) -> None:
        nonlocal t
        now = time.monotonic()
        report["phase_s"][name] = round(now - t, 2)
        t = now
        if args.json:  # partial figures survive an outer timeout
            Path(args.json).write_text(json.dumps(report, indent=2))

    report["oversized"] = phase_oversized(c, args.oversized, context, byte_limit)
    report["rss_after_oversized_mb"] = rss_mb(args.pid)
    lap("oversized")
    report["slow"] = phase_slow(c, args.slow, args.probes, args.max_slow_close_s + 5)
    lap("slow")
    report["http_errors"] = phase_http_errors(c)
    report["overload"] = phase_overload(c, args.burst, args.burst_tokens) if args.burst else None
    lap("errors_and_overload")
    if args.load:
        lg = argparse.Namespace(
            url=args.url,
            model="default",
            api_key=args.api_key,
            requests=args.load,
            duration=args.max_duration,
            concurrency=args.concurrency,
            rate=0.0,
            prompt_words=args.prompt_words,
            max_tokens=args.max_tokens,
            temperature=0.7,
            ignore_eos=False,
            disconnect_fraction=args.disconnect_fraction,
            timeout=args.timeout,
            seed=args.seed,
            mix="mixed",
        )
        report["load"] = loadgen.run(lg)
        lap("load")
    report["kv"] = kv_after(c)
    report["rss_end_mb"] = rss_mb(args.pid)
    if report["rss_idle_mb"] is not None and report["rss_end_mb"] is not None:
        report["rss_growth_oversized_mb"] = round(report["rss_after_oversized_mb"] - report["rss_idle_mb"], 1)
        report["rss_drift_mb"] = round(report["rss_end_mb"] - report["rss_idle_mb"], 1)
    if report.get("load"):
        report["tokens_per_s"] = report["load"]["tokens_per_s"]
    report["status"] = dict(sorted(c.status.items()))
    report["requests"] = sum(c.status.values()) + (report.get("load") or {}).get("requests", 0)
    load_5xx = (report.get("load") or {}).get("http_5xx", 0)
    report["http_5xx"] = sum(v for k, v in c.status.items() if k.startswith("5")) + load_5xx
    report["not_json_errors"] = c.not_json[:10]
    report["failures"] = check(report, args)
    return report


def check(r: dict, a: argparse.Namespace) -> list[str]:
    f = []
    if r["http_5xx"]:
        f.append(f"{r['http_5xx']} responses were 5xx")
    if r["not_json_errors"]:
        f.append(f"errors not in JSON: {r['not_json_errors']}")
    bad = [k for k, v in r["http_errors"].items() if not v["json_error"] or v["status"] >= 500]
    if bad:
        f.append(f"HTTP-layer errors not answered as JSON 4xx: {bad}")
    if set(r["oversized"]) - {"400_context_length_exceeded", "413_request_too_large"}:
        f.append(f"oversized prompts answered {r['oversized']}")
    if r["rss_idle_mb"] is not None and r["rss_after_oversized_mb"] is not None:
        growth = r["rss_after_oversized_mb"] - r["rss_idle_mb"]
        if growth > a.max_rss_growth_mb:
            f.append(f"RSS grew {growth:.0f} MB over {a.oversized} oversized prompts (limit {a.max_rss_growth_mb})")
    s = r["slow"]
    if s["health_max_ms"] is not None and s["health_max_ms"] > a.max_health_ms:
        f.append(f"/health,/ready,/metrics took up to {s['health_max_ms']} ms under {s['slow_connections']} slow connections")
    if s["slow_all_closed_after_s"] is None or s["slow_all_closed_after_s"] > a.max_slow_close_s:
        f.append(f"slow connections not all dropped within {a.max_slow_close_s} s ({s['slow_closed']}/{s['slow_connections']})")
    o = r["overload"]
    if o is not None and (o["rejected_429"] == 0 or o["429_with_retry_after"] != o["rejected_429"] or o["other"]):
        f.append(f"overload burst: {o}")
    kv = r["kv"]
    if kv.get("leaked_blocks") or kv.get("invariants_ok") is False:
        f.append(f"KV after the run: {kv}")
    load = r.get("load")
    if load:
        unexpected = {k: v for k, v in load["errors"].items() if not k.startswith("http_429")}
        if unexpected:
            f.append(f"load errors: {unexpected}")
    return f


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--pid", type=int, default=None, help="server process id (RSS from /proc)")
    ap.add_argument("--oversized", type=int, default=1000, help="oversized prompts to send")
    ap.add_argument("--prompt-byte-limit", type=int, default=0, help="server max_prompt_bytes (0: 16 x context)")
    ap.add_argument("--slow", type=int, default=1000, help="half-sent connections to hold open")
    ap.add_argument("--probes", type=int, default=10, help="timed /health,/ready,/metrics rounds")
    ap.add_argument("--burst", type=int, default=0, help="simultaneous requests that must partly get 429")
    ap.add_argument("--burst-tokens", type=int, default=256)
    ap.add_argument("--load", type=int, default=0, help="mixed requests (tools/loadgen.py --mix mixed)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--disconnect-fraction", type=float, default=0.2)
    ap.add_argument("--prompt-words", default="8,64,256")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--max-duration", type=float, default=3000.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-rss-growth-mb", type=float, default=100.0)
    ap.add_argument("--max-health-ms", type=float, default=100.0)
    ap.add_argument("--max-slow-close-s", type=float, default=15.0)
    ap.add_argument("--json", default=None, help="write the report here too")
    args = ap.parse_args(argv)
    report = run(args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    for msg in report["failures"]:
        print(f"hostile_check: FAIL: {msg}", file=sys.stderr)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
