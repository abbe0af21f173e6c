"""Server TOML config, MEMRA_MODELS aliases, and the keys file (add/list/revoke, atomic, hot reload)."""

from __future__ import annotations

import os

import pytest

from engine.server.auth import Keyring, presented_key
from engine.server_config import add_key, hash_key, load_server_config, read_keys, revoke_key
from engine.types import ConfigError


def test_load_config_and_models_env(tmp_path, monkeypatch):
    p = tmp_path / "server.toml"
    p.write_text(
        '[server]\nport = 9000\nmax_running = 8\nkeepalive_s = 2\nkeys_file = "k.toml"\n'
        '[models]\nsmol = "/m/smol.gguf"\n'
    )
    monkeypatch.setenv("MEMRA_MODELS", "big=/m/big.gguf, smol=/m/smol2.gguf")
    cfg = load_server_config(p, host="0.0.0.0")
    assert cfg.port == 9000 and cfg.host == "0.0.0.0" and cfg.keepalive_s == 2.0
    assert cfg.models == {"smol": "/m/smol2.gguf", "big": "/m/big.gguf"}
    assert cfg.keys_file == str(tmp_path / "k.toml") and cfg.waitress_threads == 8 + 64 + 16


@pytest.mark.parametrize(
    "text,needle",
    [
        ("[server]\nport = 'x'\n", "server.port must be int"),
        ("[server]\nbogus = 1\n", "server.bogus is not a known setting"),
        ("[nope]\n", "unknown table"),
        ("[server\n", "invalid TOML"),
        ("[server]\nport = 99999\n", "server.port 99999"),
    ],
)
def test_config_errors_name_the_key(tmp_path, text, needle):
    p = tmp_path / "s.toml"
    p.write_text(text)
    with pytest.raises(ConfigError) as ei:
        load_server_config(p)
    assert needle in str(ei.value) and str(p) in str(ei.value)


def test_models_env_error(monkeypatch):
    monkeypatch.setenv("MEMRA_MODELS", "justapath")
    with pytest.raises(ConfigError, match="MEMRA_MODELS"):
        load_server_config()


def test_keys_add_list_revoke(tmp_path):
    kf = tmp_path / "keys.toml"
    key, entry = add_key(kf, "acme", max_concurrency=3)
    add_key(kf, "beta", cache_salt="s")
    text = kf.read_text()
    assert key not in text and hash_key(key) in text  # only the hash is stored
    assert oct(os.stat(kf).st_mode & 0o777) == "0o600"
    keys = read_keys(kf)
    assert [(k.tenant, k.max_concurrency, k.cache_salt) for k in keys] == [
        ("acme", 3, "acme"),
        ("beta", 0, "s"),
    ]
    revoke_key(kf, entry.id)
    assert [k.tenant for k in read_keys(kf)] == ["beta"]
    with pytest.raises(ConfigError, match="no key with id"):
        revoke_key(kf, entry.id)
    with pytest.raises(ConfigError):
        add_key(kf, 'bad"name')
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".keys-")]  # no temp files left


def test_keyring_hot_reload(tmp_path, monkeypatch):
    from engine.server import auth

    kf = tmp_path / "keys.toml"
    p = tmp_path / "s.toml"
    p.write_text('[server]\nkeys_file = "keys.toml"\n')
    ring = Keyring(load_server_config(p))
    assert not ring.enabled and ring.authenticate(None).name == "default"  # open without keys
    key, entry = add_key(kf, "acme", max_concurrency=2)
    clock = [auth.time.monotonic() + 100.0]
    monkeypatch.setattr(auth.time, "monotonic", lambda: clock[0])
    clock[0] += 2
    t = ring.authenticate(key)
    assert t is not None and t.name == "acme" and t.max_concurrency == 2
    assert ring.authenticate("nope") is None and ring.authenticate(None) is None
    revoke_key(kf, entry.id)
    add_key(kf, "other")
    clock[0] += 2
    assert ring.authenticate(key) is None


def test_presented_key():
    assert presented_key("Bearer abc", None) == "abc"
    assert presented_key("bearer  abc ", None) == "abc"
    assert presented_key(None, "xyz") == "xyz"
    assert presented_key("Basic zzz", None) is None


def test_hardening_settings_and_tenant_rates(tmp_path):
    p = tmp_path / "s.toml"
    p.write_text(
        "[server]\nmax_running = 8\nmax_waiting = 4\nrequest_timeout_s = 3\nconnection_limit = 100\n"
        "max_prompt_bytes = 5000\ntokenizer_threads = 2\nmalloc_arena_max = 0\n"
    )
    cfg = load_server_config(p)
    assert cfg.max_in_flight == 12 and cfg.waitress_threads == 28 and cfg.request_timeout_s == 3.0
    with pytest.raises(ConfigError, match="server.threads .12. must exceed"):
        load_server_config(p, threads=12)
    keys = tmp_path / "k.toml"
    key, entry = add_key(keys, "acme", requests_per_minute=30, tokens_per_minute=9000)
    got = read_keys(keys)[0]
    assert (got.requests_per_minute, got.tokens_per_minute) == (30, 9000)
    tenant = Keyring(load_server_config(None, keys_file=str(keys))).authenticate(key)
    assert (tenant.requests_per_minute, tenant.tokens_per_minute) == (30, 9000)
    keys.write_text(keys.read_text().replace("tokens_per_minute", "tokens_per_minut"))
    with pytest.raises(ConfigError, match=r"key\[0\] has unknown field\(s\) \['tokens_per_minut'\]"):
        read_keys(keys)


def test_settings_and_key_fields_come_from_the_dataclasses(tmp_path):
    """The [server] keys and their types are ServerConfig's scalar fields; a key entry is ApiKey's
    fields, written and read back whole (sha256 lower-cased on read)."""
    from dataclasses import fields

    from engine.server_config import _SERVER_TYPES, ApiKey, ServerConfig, write_keys

    assert set(_SERVER_TYPES) == {f.name for f in fields(ServerConfig)} - {"models", "keys"}
    assert (_SERVER_TYPES["keepalive_s"], _SERVER_TYPES["port"], _SERVER_TYPES["speculative"]) == (float, int, str)
    key = ApiKey("key_1", "AB" * 32, 'a "t"', max_concurrency=2, cache_salt="s\\", created=3,
                 requests_per_minute=4, tokens_per_minute=5)
    write_keys(tmp_path / "k.toml", [key])
    text = (tmp_path / "k.toml").read_text()
    assert all(f"\n{f.name} = " in text for f in fields(ApiKey))
    (back,) = read_keys(tmp_path / "k.toml")
    assert back == ApiKey(**{**key.__dict__, "sha256": "ab" * 32})
    (tmp_path / "k.toml").write_text(text.replace('created = 3', 'created = "x"'))
    with pytest.raises(ConfigError, match=r"key\[0\] is missing or has a bad field"):
        read_keys(tmp_path / "k.toml")
