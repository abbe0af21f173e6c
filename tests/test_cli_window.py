"""`--window-kv-blocks N` on `memra serve`, `run`, `chat` and `bench` (issue #37): a bad value is one
line naming the flag before anything loads; the value (None when omitted: sized automatically)
reaches the runner with the engine limits an automatic window pool is sized for; a count for a
model without sliding-window layers is one line naming the flag."""

from __future__ import annotations

import pytest

from engine import backend, cli
from engine.backend import parse_window_kv_blocks
from engine.types import MemraError


def test_parse_window_kv_blocks():
    assert parse_window_kv_blocks(None) is None
    assert parse_window_kv_blocks("0") == 0 and parse_window_kv_blocks(" 4608 ") == 4608
    for bad in ("-1", "x", "1.5", ""):
        with pytest.raises(MemraError, match="--window-kv-blocks: expected a block count >= 0"):
            parse_window_kv_blocks(bad)


@pytest.mark.parametrize("command", ["run", "chat", "serve", "bench"])
@pytest.mark.parametrize("value", ["-3", "many"])
def test_a_bad_value_is_one_line_before_loading(monkeypatch, capsys, command, value):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the flag was checked")

    monkeypatch.setattr(cli, "load_stack", no_load)
    monkeypatch.setattr(backend, "resolve_model_path", no_load)
    extra = {"run": ["--prompt", "hi"], "serve": ["--port", "1"]}.get(command, [])
    assert cli.main([command, "/nonexistent/model", *extra, "--window-kv-blocks", value]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--window-kv-blocks" in err and repr(value) in err, err


class _Stop(MemraError):
    pass


def _runner_kwargs(monkeypatch, argv) -> dict:
    """The keyword arguments ``memra ...argv`` builds its runner with (the build is stopped there)."""
    seen: dict = {}

    def create_runner(model, backend_name="auto", device_profile=None, devices=None, split=None, detected=None,
                      **kwargs):  # fmt: skip
        seen.update(kwargs)
        raise _Stop("stopped at the runner")

    monkeypatch.setattr(backend, "create_runner", create_runner)
    assert cli.main(argv) == 2
    return seen


def test_run_and_chat_size_the_window_pool_for_one_request(monkeypatch, tiny_qwen3_dir):
    for command, extra in (("run", ["--prompt", "hi"]), ("chat", [])):
        got = _runner_kwargs(monkeypatch, [command, str(tiny_qwen3_dir), *extra, "--window-kv-blocks", "40"])
        assert got == {"window_kv_blocks": 40, "max_running": 1, "prefill_chunk_tokens": 512}
    got = _runner_kwargs(monkeypatch, ["run", str(tiny_qwen3_dir), "--prompt", "hi"])
    assert got == {"max_running": 1, "prefill_chunk_tokens": 512}  # (None: the runner's automatic size)


def test_serve_sizes_the_window_pool_for_its_max_running(monkeypatch, tmp_path, tiny_qwen3_dir):
    from engine.server import serve

    def run_server(cfg, load, raise_load_error=False):
        load()

    monkeypatch.setattr(serve, "run_server", run_server)
    cfg = tmp_path / "memra.toml"
    cfg.write_text("[server]\nmax_running = 12\n")
    got = _runner_kwargs(monkeypatch, ["serve", str(tiny_qwen3_dir), "--config", str(cfg), "--window-kv-blocks", "0"])
    # (defer_warm_up: the CUDA runner's graph captures run after /ready, engine.runner_warm)
    assert got == {"window_kv_blocks": 0, "max_running": 12, "defer_warm_up": True}
    got = _runner_kwargs(monkeypatch, ["serve", str(tiny_qwen3_dir), "--config", str(cfg)])
    assert got == {"max_running": 12, "defer_warm_up": True}  # (None: the runner's automatic size)


def test_bench_passes_the_flag_and_its_engine_chunk(monkeypatch, tiny_qwen3_dir):
    from engine.bench import ENGINE_CHUNK

    got = _runner_kwargs(monkeypatch, ["bench", str(tiny_qwen3_dir), "--window-kv-blocks", "7"])
    assert got == {"window_kv_blocks": 7, "prefill_chunk_tokens": ENGINE_CHUNK}


def test_a_count_for_a_model_without_windows_names_the_flag(capsys, tiny_qwen3_dir):
    code = cli.main(["run", str(tiny_qwen3_dir), "--backend", "reference", "--prompt", "hi", "--window-kv-blocks", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "--window-kv-blocks" in err[-1] and "sliding window" in err[-1]


def test_run_on_a_windowed_model_with_and_without_a_window_pool(tmp_path, capsys):
    """`memra run` on a tiny Gemma 3 (window 8; reference backend): the default pool, a 64-block pool
    and none give the same greedy text past the window; a pool below one sequence's window and step
    is one line naming the flag."""
    from fixtures.checkpoints import write_gemma3_safetensors, write_tokenizer_files

    model = write_gemma3_safetensors(tmp_path / "g", window=8, num_hidden_layers=7)
    write_tokenizer_files(model)
    texts = []
    for flag in ([], ["--window-kv-blocks", "64"], ["--window-kv-blocks", "0"]):
        argv = ["run", str(model), "--backend", "reference", "--prompt", "hello world, a longer prompt", "--max-tokens", "12"]
        assert cli.main(argv + flag) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] and texts[1] == texts[0] and texts[2] == texts[0]
    assert cli.main(["run", str(model), "--backend", "reference", "--prompt", "hi", "--window-kv-blocks", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "window pool (2 blocks)" in err and "--window-kv-blocks" in err
