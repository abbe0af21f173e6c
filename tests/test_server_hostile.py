"""500 malformed bodies against a real waitress server: only 4xx answers, and the server still works."""

from __future__ import annotations

import http.client
import json
import random

from server_fakes import FakeEngine, FakeTokenizer

from engine.server.app import create_app
from engine.server.model_info import ModelInfo
from engine.server.serve import BackgroundServer
from engine.server_config import ServerConfig

PATHS = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/tokenize",
    "/detokenize",
]


def _bodies(rng: random.Random, n: int) -> list[bytes]:
    good_chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    junk_values = [
        None,
        True,
        -1,
        0,
        1e308,
        10**50,
        "x" * 5000,
        [],
        {},
        [[[]]],
        "\ud800",
        -(10**30),
        3.5,
        "NaN",
    ]
    fields = [
        "messages",
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop",
        "stream",
        "seed",
        "tools",
        "tool_choice",
        "n",
        "logprobs",
        "stream_options",
        "system",
        "tokens",
        "response_format",
        "min_p",
    ]
    fixed = [
        b"",
        b"{",
        b"null",
        b"[]",
        b'"str"',
        b"\xff\xfe\xfd",
        b'{"a": NaN}',
        b'{"a": Infinity}',
        b"[" * 5000 + b"]" * 5000,
        b'{"messages": ' + b"[" * 200 + b"]" * 200 + b"}",
        b'{"max_tokens": 1' + b"0" * 400 + b"}",
        b'{"x": "\\ud800"}',
        b"\x00" * 100,
        json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(),
        json.dumps({"messages": [{"role": "user", "content": "y" * 100000}]}).encode(),
    ]
    out = list(fixed)
    while len(out) < n:
        kind = rng.random()
        if kind < 0.6:
            b = dict(good_chat)
            for _ in range(rng.randint(1, 3)):
                b[rng.choice(fields)] = rng.choice(junk_values)
            raw = json.dumps(b, ensure_ascii=False).encode("utf-8", "surrogatepass")
        elif kind < 0.8:
            raw = json.dumps(good_chat).encode()
            cut = rng.randint(0, len(raw) - 1)
            raw = raw[:cut] + bytes([rng.randint(0, 255)]) + raw[cut + 1 :]
        else:
            raw = bytes(rng.randint(0, 255) for _ in range(rng.randint(1, 200)))
        out.append(raw)
    return out[:n]


def test_hostile_bodies_only_4xx():
    eng = FakeEngine()
    info = ModelInfo("m", 4096, "fake", 1)
    app = create_app(eng, FakeTokenizer(), info, ServerConfig(max_body_bytes=64 * 1024))
    rng = random.Random(1234)
    statuses: dict[int, int] = {}
    with BackgroundServer(app) as srv:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
        for i, raw in enumerate(_bodies(rng, 500)):
            path = PATHS[i % len(PATHS)]
            try:
                conn.request("POST", path, body=raw, headers={"Content-Type": "application/json"})
                r = conn.getresponse()
                data = r.read()
            except (ConnectionError, http.client.HTTPException):
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
                continue
            statuses[r.status] = statuses.get(r.status, 0) + 1
            assert r.status < 500, (path, raw[:80], r.status, data[:300])
            if r.status >= 400:
                body = json.loads(data)
                assert "error" in body
        conn.request(
            "POST", "/v1/chat/completions", body=json.dumps({"messages": [{"role": "user", "content": "hi"}]})
        )
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["choices"][0]["message"]["content"] == "Hello, world!"
    assert sum(v for k, v in statuses.items() if 400 <= k < 500) > 400
