"""CLI polish (issue #39): keys on a fresh config that serve reads, flags rejected before loading,
--stats decode rate over the engine's decode time."""

from __future__ import annotations

import argparse
import json

import pytest

from engine import cli
from engine.server_config import load_server_config
from engine.types import TokenEvent, Usage


def test_keys_add_on_a_new_config_is_what_serve_reads(tmp_path, capsys):
    cfg = tmp_path / "memra.toml"
    assert cli.main(["keys", "add", "--config", str(cfg), "--tenant", "team"]) == 0
    key = capsys.readouterr().out.split("store it now): ")[1].split()[0]
    loaded = load_server_config(cfg)  # what `memra serve --config` does first
    keys = loaded.load_keys()
    assert [k.tenant for k in keys] == ["team"] and key not in (tmp_path / "memra.keys.toml").read_text()
    assert cli.main(["keys", "add", "--config", str(cfg), "--tenant", "other"]) == 0
    assert len(load_server_config(cfg).load_keys()) == 2
    assert cli.main(["keys", "list", "--config", str(cfg)]) == 0
    assert "tenant=other" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags,word",
    [
        (["--temperature", "-3"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--max-tokens", "0"], "max-tokens"),
        (["--repetition-penalty", "0"], "repetition_penalty"),
    ],
)
def test_bad_flags_fail_before_loading(monkeypatch, capsys, flags, word):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(cli, "load_stack", no_load)
    assert cli.main(["run", "--prompt", "hi", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and word in err


class _Handle:
    def __init__(self, events):
        self.events = events

    def __iter__(self):
        return iter(self.events)


class _Engine:
    def __init__(self, events):
        self.events = events

    def submit(self, req):
        return _Handle(self.events)


def test_stats_decode_rate_uses_engine_time(monkeypatch):
    """Events read all at once (a reader starved while the engine ran) still give the real rate."""
    t = 1000.0
    evs = [TokenEvent("r", [5], "a", created_s=t + 0.1 * i) for i in range(7)]
    evs.append(TokenEvent("r", [5], "a", finish_reason="length", usage=Usage(3, 8, 0), created_s=t + 0.7))
    args = argparse.Namespace(
        temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, seed=None, max_tokens=8
    )

    class _Out:
        def write(self, s):
            pass

        def flush(self):
            pass

    _, stats = cli._generate(_Engine(evs), [1, 2, 3], args, out=_Out())
    assert stats["decode_tok_s"] == pytest.approx(10.0)  # 7 tokens after the first over 0.7 s


def test_stack_flags_are_read_the_same_way_by_every_subcommand():
    """engine.backend.StackFlags: run, chat, serve and bench read the model-loading flags in one place
    (a subcommand without --devices gets the default), checked before anything loads."""
    from engine.backend import StackFlags
    from engine.types import MemraError

    p = cli.build_parser()
    for argv in (["run", "--prompt", "x"], ["chat"], ["serve"], ["bench"]):
        f = StackFlags.of(p.parse_args([*argv, "--quant", "q8_0", "--window-kv-blocks", "3", "--no-overlap"]))
        assert f == StackFlags(quant="q8_0", window_kv_blocks=3, overlap=False), argv
        assert StackFlags.of(p.parse_args(argv)) == StackFlags(overlap=True)
    f = StackFlags.of(p.parse_args(["run", "--prompt", "x", "--devices", "0,1", "--split", "pp"]))
    assert (f.devices, f.split) == ("0,1", "pp")
    with pytest.raises(MemraError, match="need --split"):
        StackFlags.of(p.parse_args(["serve", "--devices", "0,1"]))
    with pytest.raises(MemraError, match="--window-kv-blocks"):
        StackFlags.of(p.parse_args(["chat", "--window-kv-blocks", "-1"]))


def test_chat_holds_a_conversation_and_resets_it(tiny_qwen3_dir, monkeypatch, capsys):
    """`memra chat` (cli._one_request_engine): each line a turn with --stats, /reset keeps only the
    system prompt, empty lines are skipped, /exit ends; the engine is shut down."""
    lines = iter(["hi", "/reset", "  ", "again", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    argv = ["chat", str(tiny_qwen3_dir), "--backend", "reference", "--max-tokens", "2", "--stats", "--system", "s"]
    assert cli.main(argv) == 0
    stats = [line for line in capsys.readouterr().err.splitlines() if line.startswith("memra: {")]
    assert len(stats) == 2
    assert json.loads(stats[0][7:])["prompt_tokens"] == json.loads(stats[1][7:])["prompt_tokens"] - 1  # "again" vs "hi"
