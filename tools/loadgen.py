"""Load generator for a local memra server: Poisson or closed-loop streaming chat requests, TTFT/ITL report.

Loopback only (127.0.0.0/8, ::1, localhost); count and duration are bounded. Uses only the standard
library (http.client), so it measures the server, not a client SDK. Must not import the engine.

    python tools/loadgen.py --url http://127.0.0.1:8000 --requests 200 --concurrency 8
    python tools/loadgen.py --rate 4 --duration 60 --disconnect-fraction 0.1 --json out.json
"""

from __future__ import annotations

import argparse
import http.client
import ipaddress
import json
import random
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlparse

MAX_REQUESTS = 100_000
MAX_DURATION_S = 3600.0
WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
    "quebec romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()


def check_loopback(url: str) -> tuple[str, int]:
    """Return (host, port) or raise SystemExit when the URL does not point at this machine's loopback."""
    u = urlparse(url)
    if u.scheme != "http" or not u.hostname:
        raise SystemExit(f"loadgen: {url!r}: only http://<loopback>:<port> URLs are allowed")
    host = u.hostname
    addrs = {ai[4][0] for ai in socket.getaddrinfo(host, u.port or 80, proto=socket.IPPROTO_TCP)}
    for a in addrs:
        if not ipaddress.ip_address(a.split("%")[0]).is_loopback:
            raise SystemExit(f"loadgen: {host} resolves to {a}, which is not loopback; refusing")
    return host, u.port or 80


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    tokens: int = 0
    prompt_words: int = 0
    duration_s: float = 0.0
    disconnected: bool = False


def one_request(
    host: str,
    port: int,
    model: str,
    api_key: str | None,
    prompt_words: int,
    max_tokens: int,
    disconnect_after: int | None,
    timeout_s: float,
    rng: random.Random,
    temperature: float = 0.7,
    ignore_eos: bool = False,
) -> Result:
    res = Result(prompt_words=prompt_words)
    prompt = " ".join(rng.choice(WORDS) for _ in range(prompt_words))
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": temperature,
            **({"ignore_eos": True} if ignore_eos else {}),
        }
    )
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    t0 = time.monotonic()
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
        r = conn.getresponse()
        if r.status != 200:
            try:
                code = json.loads(r.read()).get("error", {}).get("code") or ""
            except ValueError:
                code = ""
            res.error = f"http_{r.status}" + (f"_{code}" if code else "")
            return res
        last = None
        chunks = 0
        for raw in r:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            if payload == "[DONE]":
                res.ok = True
                break
            obj = json.loads(payload)
            if "error" in obj:
                res.error = "stream_" + str(obj["error"].get("code") or "error")
                break
            if obj.get("usage"):
                res.tokens = obj["usage"].get("completion_tokens", res.tokens)
            ch = obj.get("choices") or []
            if ch and ch[0].get("delta", {}).get("content"):
                now = time.monotonic()
                if last is None:
                    res.ttft_s = now - t0
                else:
                    res.itl_s.append(now - last)
                last = now
                chunks += 1
                if disconnect_after is not None and chunks >= disconnect_after:
                    res.disconnected = True
                    res.ok = True
                    break
        if not res.ok and not res.error:
            res.error = "truncated_stream"
    except (OSError, http.client.HTTPException) as exc:
        res.error = type(exc).__name__
    finally:
        conn.close()
        res.duration_s = time.monotonic() - t0
    return res


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def summarize(results: list[Result], wall_s: float) -> dict:
    ttft = [r.ttft_s for r in results if r.ttft_s is not None]
    itl = [x for r in results for x in r.itl_s]
    errors: dict[str, int] = {}
    for r in results:
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    toks = sum(r.tokens for r in results)
    return {
        "requests": len(results),
        "ok": sum(r.ok for r in results),
        "disconnected": sum(r.disconnected for r in results),
        "errors": errors,
        "wall_s": round(wall_s, 3),
        "generated_tokens": toks,
        "tokens_per_s": round(toks / wall_s, 2) if wall_s > 0 else 0.0,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "itl_p50_s": pct(itl, 50),
        "itl_p99_s": pct(itl, 99),
    }


def table(s: dict) -> str:
    def ms(v):
        return "-" if v is None else f"{v * 1000:.1f} ms"

    rows = [
        ("requests (ok / disconnected)", f"{s['requests']} ({s['ok']} / {s['disconnected']})"),
        ("errors", ", ".join(f"{k}={v}" for k, v in s["errors"].items()) or "none"),
        ("wall time", f"{s['wall_s']:.2f} s"),
        ("generated tokens", str(s["generated_tokens"])),
        ("throughput", f"{s['tokens_per_s']:.1f} tok/s"),
        ("TTFT p50 / p99", f"{ms(s['ttft_p50_s'])} / {ms(s['ttft_p99_s'])}"),
        ("ITL p50 / p99", f"{ms(s['itl_p50_s'])} / {ms(s['itl_p99_s'])}"),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def run(args: argparse.Namespace) -> dict:
    host, port = check_loopback(args.url)
    n = min(args.requests, MAX_REQUESTS)
    deadline = time.monotonic() + min(args.duration, MAX_DURATION_S)
    rng = random.Random(args.seed)
    lengths = [int(x) for x in args.prompt_words.split(",")]
    plan = [
        (
            rng.choice(lengths),
            (rng.randint(1, 4) if rng.random() < args.disconnect_fraction else None),
            random.Random(rng.random()),
        )
        for _ in range(n)
    ]
    results: list[Result] = []
    lock = threading.Lock()
    idx = [0]

    def do(i: int) -> None:
        words, disc, r = plan[i]
        res = one_request(
            host,
            port,
            args.model,
            args.api_key,
            words,
            args.max_tokens,
            disc,
            args.timeout,
            r,
            getattr(args, "temperature", 0.7),
            getattr(args, "ignore_eos", False),
        )
        with lock:
            results.append(res)

    t0 = time.monotonic()
    threads: list[threading.Thread] = []
    if args.rate > 0:  # open loop: Poisson arrivals
        for i in range(n):
            if time.monotonic() >= deadline:
                break
            t = threading.Thread(target=do, args=(i,), daemon=True)
            t.start()
            threads.append(t)
            time.sleep(rng.expovariate(args.rate))
    else:  # closed loop: `concurrency` workers, each starts a new request when the last finished

        def worker() -> None:
            while time.monotonic() < deadline:
                with lock:
                    if idx[0] >= n:
                        return
                    i = idx[0]
                    idx[0] += 1
                do(i)

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, args.concurrency))]
        for t in threads:
            t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()) + args.timeout)
    return summarize(results, time.monotonic() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="default")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--requests", type=int, default=100, help=f"at most {MAX_REQUESTS}")
    ap.add_argument("--duration", type=float, default=300.0, help=f"seconds, at most {MAX_DURATION_S:.0f}")
    ap.add_argument("--concurrency", type=int, default=4, help="closed-loop workers (when --rate is 0)")
    ap.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second (open loop)")
    ap.add_argument(
        "--prompt-words", default="8,64,256", help="comma-separated prompt lengths, chosen at random"
    )
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument(
        "--ignore-eos", action="store_true", help="generate exactly --max-tokens (the engine bench's workload)"
    )
    ap.add_argument(
        "--disconnect-fraction", type=float, default=0.0, help="fraction that hang up after 1-4 chunks"
    )
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the summary JSON here ('-' = stdout)")
    args = ap.parse_args(argv)
    summary = run(args)
    if args.json == "-":
        print(json.dumps(summary, indent=2))
    elif args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
    print(table(summary))
    return 0 if not summary["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["Result", "asdict", "check_loopback", "main", "run", "summarize"]
