"""`--speculative` / `--spec-tokens` on `memra run` and `memra bench` (reference backend, in process),
the serving field `speculative`, and speculation on the real SmolLM2 (slow)."""

from __future__ import annotations

import json

import pytest

from engine.cli import main


def _run(capfd, *args):
    rc = main(["run", *args, "--backend", "reference", "--max-tokens", "12", "--stats"])
    out, err = capfd.readouterr()
    return rc, out, err


def test_run_with_speculation_prints_the_same_text_and_its_stats(capfd, tiny_llama_dir):
    p = str(tiny_llama_dir)
    rc, plain, _ = _run(capfd, p, "--prompt", "the and of to in the and of to in the")
    assert rc == 0
    for spec in (["--speculative", "ngram", "--spec-tokens", "3"], ["--speculative", f"draft:{p}"]):
        rc, out, err = _run(capfd, p, "--prompt", "the and of to in the and of to in the", *spec)
        assert rc == 0, err
        assert out == plain
        stats = json.loads(err.strip().splitlines()[-1].removeprefix("memra: "))
        assert stats["speculative"] == spec[1].split(":")[0]
        assert stats["spec_draft_tokens"] >= stats["spec_accepted_tokens"] >= 0
        if spec[1].startswith("draft"):  # the target as its own draft accepts everything
            assert stats["spec_acceptance_rate"] == 1.0 and stats["spec_mean_accepted_length"] > 1.5


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--speculative", "mtp"], "has no MTP head"),
        (["--speculative", "draft:/nonexistent/model"], "/nonexistent/model"),
        (["--speculative", "ngram", "--spec-tokens", "99"], "--spec-tokens must be between 1 and 16"),
        (["--spec-tokens", "2"], "needs --speculative"),
    ],
)
def test_bad_speculative_flags_are_one_line_errors(capfd, tiny_llama_dir, flags, message):
    rc, out, err = _run(capfd, str(tiny_llama_dir), "--prompt", "hi", *flags)
    assert rc == 2
    last = err.strip().splitlines()[-1]
    assert message in last and "Traceback" not in err


def test_bench_engine_rows_report_acceptance(capfd, tiny_llama_dir, tmp_path):
    p = str(tiny_llama_dir)
    rc = main(
        ["bench", p, "--backend", "reference", "--concurrency", "1,2", "--prompt-tokens", "8",
         "--gen-tokens", "6", "--json", str(tmp_path / "b.json"), "--speculative", f"draft:{p}"]
    )
    out, _ = capfd.readouterr()
    assert rc == 0
    rows = [r for r in json.loads((tmp_path / "b.json").read_text())["rows"] if r["kind"] == "engine"]
    assert [r["concurrency"] for r in rows] == [1, 2]
    assert all(r["spec_acceptance_rate"] == 1.0 and r["spec_mean_accepted_length"] > 1 for r in rows)
    assert "draft: acceptance 100%, mean accepted length" in out


def test_speculative_request_field_is_parsed():
    from engine.server.schemas import parse_chat

    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat(body).speculative is True
    assert parse_chat({**body, "speculative": False}).speculative is False
    from engine.server.errors import ApiError

    with pytest.raises(ApiError, match="`speculative` must be a boolean"):
        parse_chat({**body, "speculative": "no"})


@pytest.mark.slow
def test_smollm2_greedy_with_prompt_lookup_equals_plain(smollm2_path):
    """The real SmolLM2 (Q4_1, reference backend): an edit-the-text prompt that prompt lookup suits,
    greedy with ngram speculation batched with a second prompt == plain greedy, token for token."""
    from engine.loop import Engine, EngineConfig
    from engine.model import load_model
    from engine.reference import ReferenceRunner
    from engine.spec.build import build_speculator
    from engine.spec.config import SpecConfig
    from engine.tokenizer import load_tokenizer
    from engine.types import GenerationRequest, SamplingParams

    model = load_model(smollm2_path)
    tok = load_tokenizer(model.weights)
    text = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    prompts = [
        tok.encode(tok.apply_chat_template(
            [{"role": "user", "content": f"Rename the functions to plus and minus:\n{text}"}],
            add_generation_prompt=True,
        )),
        tok.encode("The capital of France is"),
    ]
    runner = ReferenceRunner(model, num_blocks=64, block_size=16, max_model_len=1024)

    def gen(spec):
        e = Engine(runner, tok, EngineConfig(), speculator=build_speculator(spec, model, runner))
        hs = [
            e.submit(GenerationRequest(f"r{i}", p, SamplingParams(temperature=0.0), max_tokens=20, ignore_eos=True))
            for i, p in enumerate(prompts)
        ]
        e.start()
        try:
            return [[t for ev in h for t in ev.token_ids] for h in hs], e.stats()
        finally:
            e.shutdown(5)

    plain, _ = gen(None)
    spec, stats = gen(SpecConfig("ngram", k=4))
    assert spec == plain
    assert stats.spec_accepted_tokens > 0


def test_metrics_expose_speculation_counters_with_vllm_names():
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    from engine.server.metrics import Metrics

    stats = SimpleNamespace(spec_draft_tokens=40, spec_accepted_tokens=31, spec_verify_rows=12)
    m = Metrics()
    m.model_name = "smol"
    text = m.render(stats, alive=True, draining=False)
    samples = {
        s.name: s for f in text_string_to_metric_families(text) for s in f.samples if "spec" in s.name
    }
    for name, value in (
        ("memra_spec_draft_tokens_total", 40),
        ("memra_spec_accepted_tokens_total", 31),
        ("memra_spec_verify_rows_total", 12),
        ("vllm:spec_decode_num_draft_tokens_total", 40),
        ("vllm:spec_decode_num_accepted_tokens_total", 31),
        ("vllm:spec_decode_num_drafts_total", 12),
    ):
        assert samples[name].value == value, name
        assert samples[name].labels == ({"model_name": "smol"} if name.startswith("vllm:") else {}), name
    assert "# TYPE vllm:spec_decode_num_draft_tokens_total counter" in text.splitlines()


def test_server_with_a_draft_model_honours_the_opt_out_and_counts_in_metrics(tiny_llama_dir):
    """`memra serve --speculative draft:PATH` stack (build_engine) behind the Falcon app: the same
    greedy completion with and without `"speculative": false`; /metrics counts the drafts."""
    import falcon.testing

    from engine.backend import StackFlags
    from engine.server.app import create_app
    from engine.server.launch import build_engine
    from engine.server_config import ServerConfig
    from engine.spec.config import SpecConfig

    cfg = ServerConfig()
    engine, tok, info = build_engine(
        str(tiny_llama_dir), ("default",), cfg, StackFlags("reference"), SpecConfig("draft", str(tiny_llama_dir))
    )
    try:
        client = falcon.testing.TestClient(create_app(engine, tok, info, cfg))
        body = {"prompt": "the and of to in", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        on = client.simulate_post("/v1/completions", json=body)
        assert on.status_code == 200, on.text
        drafted = engine.stats().spec_draft_tokens
        assert drafted > 0
        off = client.simulate_post("/v1/completions", json={**body, "speculative": False})
        assert off.status_code == 200, off.text
        assert engine.stats().spec_draft_tokens == drafted  # the opted-out request drafted nothing
        assert on.json["choices"][0]["text"] == off.json["choices"][0]["text"]
        metrics = client.simulate_get("/metrics").text
        assert f'vllm:spec_decode_num_draft_tokens_total{{model_name="{info.id}"}} {float(drafted)}' in metrics
    finally:
        engine.shutdown(5)


def test_server_config_speculative_keys(tmp_path):
    from engine.server_config import load_server_config
    from engine.types import ConfigError

    f = tmp_path / "s.toml"
    f.write_text('[server]\nspeculative = "ngram"\nspec_tokens = 3\n')
    cfg = load_server_config(f)
    assert (cfg.speculative, cfg.spec_tokens) == ("ngram", 3)
    assert load_server_config(f, speculative="mtp").speculative == "mtp"  # the flag wins
    f.write_text("[server]\nspec_tokens = \"four\"\n")
    with pytest.raises(ConfigError, match="server.spec_tokens must be int"):
        load_server_config(f)
