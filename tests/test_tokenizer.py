"""engine.tokenizer: GGUF-built SmolLM2 BPE, tokenizer.json dirs, BOS/EOS policy, incremental decoding."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from engine.tokenizer import load_tokenizer
from engine.types import MemraError
from engine.weights import open_weights

CORPUS = [
    "What is the capital of France?",
    "Hello, world! It's 2024; we'll see 3.14159 and 1,000,000.",
    "def fib(n):\n    if n < 2:\n        return n\n\treturn fib(n - 1) + fib(n - 2)\n",
    "emoji 🎉🚀👍🏽 and flags 🇫🇷",
    "日本語のテキストと中文字符，한국어도.",
    "   leading spaces, trailing   \n\n\n  runs\t\t of  whitespace   ",
    "Ünïcödé açcénts — “quotes” ‘single’ … and ß.",
    "<|im_start|>user\nhi<|im_end|>\n",
]


@pytest.fixture(scope="module")
def smol(smollm2_source):
    return load_tokenizer(smollm2_source)


def test_smollm2_properties(smol) -> None:
    assert smol.vocab_size == 49152
    assert smol.bos_token_id == 1 and not smol.add_bos
    assert {2} <= smol.eos_token_ids and 1 not in smol.eos_token_ids
    assert smol.token_to_id("<|im_start|>") == 1 and smol.token_to_id("<|im_end|>") == 2
    assert smol.id_to_token(2) == "<|im_end|>"
    assert smol.eos_token_id == 2 and smol.eos_token == "<|im_end|>" and smol.bos_token == "<|im_start|>"
    assert smol.encode("<|im_start|>user<|im_end|>")[0] == 1
    assert smol.encode("<|im_start|>user<|im_end|>")[-1] == 2
    assert smol.encode("hi", add_special_tokens=True) == smol.encode("hi")  # add_bos_token is false
    assert smol.chat_template and "<|im_start|>" in smol.chat_template


@pytest.mark.parametrize("text", CORPUS)
def test_smollm2_round_trip(smol, text: str) -> None:
    ids = smol.encode(text)
    assert smol.decode(ids, skip_special_tokens=False) == text
    assert smol.decode(ids) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")


# --- an independent byte-level BPE, from the GGUF merges, for ASCII text -------------------------


def _byte_to_unicode() -> dict[int, str]:
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def _reference_bpe(text: str, tokens: list[str], merges: list[str]) -> list[int]:
    ranks = {tuple(m.split(" ")): i for i, m in enumerate(merges)}
    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}
    b2u = _byte_to_unicode()
    # smollm pre-tokenisation on ASCII: each digit alone, then the GPT-2 regex
    pieces = []
    for chunk in re.split(r"(\d)", text):
        pieces += re.findall(
            r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?\d+| ?[^\sA-Za-z\d]+|\s+(?!\S)|\s+", chunk
        )
    out = []
    for p in pieces:
        word = [b2u[b] for b in p.encode()]
        while len(word) > 1:
            pairs = [
                (ranks.get((a, b), 1 << 30), i) for i, (a, b) in enumerate(zip(word, word[1:], strict=False))
            ]
            rank, i = min(pairs)
            if rank == 1 << 30:
                break
            word[i : i + 2] = [word[i] + word[i + 1]]
        out += [vocab[w] for w in word]
    return out


@pytest.mark.parametrize("text", CORPUS[:3] + ["The year 1999 isn't 2000; don't panic."])
def test_smollm2_matches_independent_bpe(smol, smollm2_source, text: str) -> None:
    md = smollm2_source.metadata
    assert smol.encode(text) == _reference_bpe(text, md["tokenizer.ggml.tokens"], md["tokenizer.ggml.merges"])


def test_known_ids(smol) -> None:
    # ids of the SmolLM2 HF tokenizer for this sentence (What / is / the / capital / of / France / ?)
    assert smol.encode("What is the capital of France?") == [1780, 314, 260, 3575, 282, 4649, 47]


@pytest.mark.slow
def test_smollm2_matches_transformers_gguf_conversion(smol, smollm2_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)
    for text in CORPUS:
        assert smol.encode(text) == hf.encode(text, add_special_tokens=False), text


# --- streaming decode ---------------------------------------------------------------------------


@pytest.mark.parametrize("text", CORPUS)
def test_incremental_decoder_one_token_at_a_time(smol, text: str) -> None:
    ids = smol.encode(text)
    dec = smol.incremental_decoder(skip_special_tokens=False)
    pieces = [dec.push([i]) for i in ids]
    pieces.append(dec.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_incremental_decoder_holds_partial_utf8(smol) -> None:
    ids = smol.encode("🎉")
    assert len(ids) > 1  # a multi-byte char split over byte-level tokens
    dec = smol.incremental_decoder()
    assert [dec.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert dec.push(ids[-1:]) == "🎉"
    assert dec.flush() == ""
    dec = smol.incremental_decoder()
    dec.push(ids[:1])
    assert dec.flush() == "\ufffd"  # an incomplete tail at the end is flushed, not lost


def test_incremental_decoder_skips_specials(smol) -> None:
    dec = smol.incremental_decoder()
    ids = smol.encode("<|im_start|>assistant\nParis<|im_end|>")
    assert "".join(dec.push([i]) for i in ids) + dec.flush() == "assistant\nParis"


# --- HF directories and GGUF fixtures -----------------------------------------------------------


def test_hf_dir_tokenizer(tiny_qwen3_dir: Path) -> None:
    tok = load_tokenizer(open_weights(tiny_qwen3_dir))
    assert tok.vocab_size == 384
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert tok.eos_token_ids == frozenset({0, 2})  # tokenizer_config eos + generation_config [2, 0]
    assert tok.eos_token_id == 2 and tok.eos_token == "<|im_end|>" and tok.bos_token_id == 0
    assert not tok.add_bos
    text = "What is the capital of France? 42"
    assert tok.decode(tok.encode(text)) == text
    assert (
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_hf_dir_chat_template_file_and_bos(tmp_path: Path, tiny_llama_dir: Path) -> None:
    import shutil

    d = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.update(bos_token="<|endoftext|>", add_bos_token=True)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}[{{ m.content }}]{% endfor %}"
    )
    tok = load_tokenizer(open_weights(d))
    assert tok.encode("hi", add_special_tokens=True)[0] == 0 and tok.encode("hi")[0] != 0
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|endoftext|>[x]"


def test_gguf_fixture_tokenizer_equals_hf(tiny_llama_dir: Path, tiny_llama_gguf: Path) -> None:
    hf, gg = load_tokenizer(open_weights(tiny_llama_dir)), load_tokenizer(open_weights(tiny_llama_gguf))
    assert hf.vocab_size == gg.vocab_size and hf.eos_token_ids >= {2} and 2 in gg.eos_token_ids
    for text in CORPUS:
        assert gg.encode(text) == hf.encode(text), text
        assert gg.decode(gg.encode(text), skip_special_tokens=False) == text


def test_unsupported_gguf_tokenizers(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    def make(model: str, pre: str) -> Path:
        p = tmp_path / f"{model}-{pre}.gguf"
        w = gguf.GGUFWriter(str(p), "llama")
        w.add_tokenizer_model(model)
        w.add_tokenizer_pre(pre)
        w.add_token_list(["a", "b"])
        w.add_token_merges([])
        w.add_tensor("x.weight", np.zeros(2, np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return p

    with pytest.raises(MemraError, match="tokenizer model 'bert' is not supported"):
        load_tokenizer(open_weights(make("bert", "default")))
    with pytest.raises(MemraError, match="SentencePiece GGUF vocab without tokenizer.ggml.scores"):
        load_tokenizer(open_weights(make("llama", "default")))
    with pytest.raises(
        MemraError, match="unsupported GGUF tokenizer.ggml.pre 'mystery'; supported: .*smollm.*qwen2"
    ):
        load_tokenizer(open_weights(make("gpt2", "mystery")))


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("gpt-2", ["Hello", "Ġ12345", "Ġworld", "'s"]),
        ("smollm", ["Hello", "Ġ", "1", "2", "3", "4", "5", "Ġworld", "'s"]),
        ("qwen2", ["Hello", "Ġ", "1", "2", "3", "4", "5", "Ġworld", "'S"]),
        ("llama-bpe", ["Hello", "Ġ", "123", "45", "Ġworld", "'S"]),
    ],
)
def test_pre_tokenizer_by_gguf_name(pre: str, pieces: list[str]) -> None:
    from engine.tokenizer import _pre_tokenizer

    text = "Hello 12345 world's" if pre in ("gpt-2", "smollm") else "Hello 12345 world'S"
    assert [p for p, _ in _pre_tokenizer(pre).pre_tokenize_str(text)] == pieces
