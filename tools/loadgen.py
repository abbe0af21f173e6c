"""Load generator for a local memra server: Poisson or closed-loop requests, TTFT/ITL/status report.

Loopback only (127.0.0.0/8, ::1, localhost); count and duration are bounded. Uses only the standard
library (http.client), so it measures the server, not a client SDK. Must not import the engine.
``--mix chat`` (default) sends streaming OpenAI chat requests; ``--mix mixed`` picks, per request,
OpenAI chat / OpenAI completions / Anthropic messages, streaming or not; a disconnecting request
hangs up after 1-4 chunks (streaming) or right after sending (non-streaming).

    python tools/loadgen.py --url http://127.0.0.1:8000 --requests 200 --concurrency 8
    python tools/loadgen.py --rate 4 --duration 60 --disconnect-fraction 0.1 --json out.json
    python tools/loadgen.py --mix mixed --requests 10000 --concurrency 64 --disconnect-fraction 0.2
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
    status: int = 0  # HTTP status (0: none received)
    prompt_tokens: int = 0  # from a streamed chat's usage chunk
    cached_tokens: int | None = None  # ... its prompt_tokens_details.cached_tokens (prefix-cache hit)
    kind: str = "chat_stream"


KINDS = (
    "chat_stream",
    "chat",
    "completions_stream",
    "completions",
    "messages_stream",
    "messages",
)


def _request_body(kind: str, model: str, prompt: str, max_tokens: int, temperature: float, ignore_eos: bool):
    """(path, body) of one request of ``kind``."""
    stream = kind.endswith("_stream")
    extra = {"ignore_eos": True} if ignore_eos else {}
    if kind.startswith("messages"):
        body = {
            "model": model,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": min(temperature, 1.0),
            "stream": stream,
        }
        return "/v1/messages", body
    common = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "stream": stream, **extra}
    if stream:
        common["stream_options"] = {"include_usage": True}
    if kind.startswith("completions"):
        return "/v1/completions", {**common, "prompt": prompt}
    return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}]}


def _read_anthropic_stream(r, res: Result, t0: float, disconnect_after: int | None) -> None:
    last = None
    chunks = 0
    event = ""
    for raw in r:
        line = raw.decode("utf-8", "replace").strip()
        if line.startswith("event: "):
            event = line[7:]
            if event == "message_stop":
                res.ok = not res.error
                return
            continue
        if not line.startswith("data: "):
            continue
        obj = json.loads(line[6:])
        if event == "error":
            res.error = "stream_" + str(obj.get("error", {}).get("type") or "error")
        elif event == "message_delta":
            res.tokens = obj.get("usage", {}).get("output_tokens", res.tokens)
        elif event == "content_block_delta":
            now = time.monotonic()
            if last is None:
                res.ttft_s = now - t0
            else:
                res.itl_s.append(now - last)
            last = now
            chunks += 1
            if disconnect_after is not None and chunks >= disconnect_after:
                res.disconnected = res.ok = True
                return


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
    kind: str = "chat_stream",
) -> Result:
    res = Result(prompt_words=prompt_words, kind=kind)
    prompt = " ".join(rng.choice(WORDS) for _ in range(prompt_words))
    path, body = _request_body(kind, model, prompt, max_tokens, temperature, ignore_eos)
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
        headers["x-api-key"] = api_key
    t0 = time.monotonic()
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("POST", path, body=json.dumps(body), headers=headers)
        if disconnect_after is not None and not kind.endswith("_stream"):
            time.sleep(0.05 * disconnect_after)  # hang up while the server is generating
            res.disconnected = res.ok = True
            return res
        r = conn.getresponse()
        res.status = r.status
        if r.status != 200:
            try:
                err = json.loads(r.read())
                code = err.get("error", {}).get("code") or err.get("error", {}).get("type") or ""
            except ValueError:
                code = "not_json"
            res.error = f"http_{r.status}" + (f"_{code}" if code else "")
            return res
        if not kind.endswith("_stream"):
            obj = json.loads(r.read())
            usage = obj.get("usage") or {}
            res.tokens = usage.get("completion_tokens", usage.get("output_tokens", 0))
            res.ttft_s = time.monotonic() - t0
            res.ok = True
            return res
        if kind.startswith("messages"):
            _read_anthropic_stream(r, res, t0, disconnect_after)
            if not res.ok and not res.error:
                res.error = "truncated_stream"
            return res
        last = None
        chunks = 0
        for raw in r:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            if payload == "[DONE]":
                res.ok = not res.error
                break
            obj = json.loads(payload)
            if "error" in obj:
                res.error = "stream_" + str(obj["error"].get("code") or "error")
                continue  # [DONE] still follows
            if obj.get("usage"):
                usage = obj["usage"]
                res.tokens = usage.get("completion_tokens", res.tokens)
                res.prompt_tokens = usage.get("prompt_tokens", 0)
                res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            ch = obj.get("choices") or []
            text = (ch[0].get("delta", {}).get("content") or ch[0].get("text")) if ch else None
            if text:
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
    except (OSError, http.client.HTTPException, ValueError) as exc:
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
    status: dict[str, int] = {}
    kinds: dict[str, int] = {}
    for r in results:
        key = str(r.status) if r.status else "none"
        status[key] = status.get(key, 0) + 1
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
    return {
        "requests": len(results),
        "ok": sum(r.ok for r in results),
        "disconnected": sum(r.disconnected for r in results),
        "errors": errors,
        "status": status,
        "http_5xx": sum(1 for r in results if r.status >= 500),
        "kinds": kinds,
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
        ("HTTP status", ", ".join(f"{k}={v}" for k, v in sorted(s["status"].items()))),
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
    kinds = KINDS if getattr(args, "mix", "chat") == "mixed" else ("chat_stream",)
    plan = [
        (
            rng.choice(lengths),
            (rng.randint(1, 4) if rng.random() < args.disconnect_fraction else None),
            random.Random(rng.random()),
            kinds[i % len(kinds)],
        )
        for i in range(n)
    ]
    results: list[Result] = []
    lock = threading.Lock()
    idx = [0]

    def do(i: int) -> None:
        words, disc, r, kind = plan[i]
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
            kind,
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
    ap.add_argument(
        "--mix", default="chat", choices=["chat", "mixed"], help="mixed: chat/completions/messages, stream or not"
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
