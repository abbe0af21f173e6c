"""Load a tokenizer for a WeightSource (tokenizer.json or GGUF vocab/merges), chat templates, streaming decode.

Must not import CUDA, numpy-heavy code or the model graph; uses ``tokenizers``, engine.chat_template and engine.token_cache.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from engine.chat_template import render_chat_template
from engine.token_cache import SegmentEncoder
from engine.tokenizer_spm import spm_tokenizer
from engine.types import ConfigError, MemraError
from engine.weights.source import WeightSource

#: End-of-turn tokens that stop generation when present in the vocabulary as special tokens
#: (the same idea as llama.cpp's end-of-generation set).
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<end_of_turn>",
    "<|end|>",
)

#: Inserted after the first character of a special-token string found in untrusted text (message
#: content) by ``Tokenizer.escape_specials``; ``encode_chat`` drops it and reads that text as text.
#: A mark already in the text is doubled, so no input can forge or hide one.
CONTENT_MARK = "\ue000"
_MARK_RUN = re.compile(CONTENT_MARK + CONTENT_MARK + "?")

_QWEN2_RE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_RE = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(tokenizers.Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The HF pre-tokenizer matching llama.cpp's ``tokenizer.ggml.pre`` name."""
    if pre in ("gpt-2", "default", "gpt2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # SmolLM/StarCoder: single digits, then the GPT-2 regex
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in ("qwen2", "qwen3"):
        return _split(_QWEN2_RE)
    if pre in ("llama-bpe", "llama3"):
        return _split(_LLAMA3_RE)
    raise MemraError(
        f"unsupported GGUF tokenizer.ggml.pre {pre!r}; supported: default, gpt-2, smollm, qwen2, llama-bpe",
        code="invalid_model",
    )


class IncrementalDecoder:
    """Turns a stream of token ids into text pieces, never emitting half a UTF-8 character."""

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool = True):
        self._tok = tok
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the window re-decoded for context
        self._read = 0  # ids up to here have been emitted

    def push(self, ids: Sequence[int]) -> str:
        """Add ``ids``; return the newly complete text ('' while a character is still incomplete)."""
        self._ids.extend(int(i) for i in ids)
        prev = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix :], self._skip)
        if len(text) <= len(prev) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(prev) :]

    def flush(self) -> str:
        """Whatever is left (an incomplete tail decodes with U+FFFD); resets nothing else."""
        prev = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix :], self._skip)
        self._prefix = self._read = len(self._ids)
        return text[len(prev) :] if text.startswith(prev) else text


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus BOS/EOS policy and the model's chat template."""

    def __init__(
        self,
        tk: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        add_bos: bool,
        eos_token_ids: frozenset[int],
        eos_token_id: int | None = None,
        chat_template: str | None,
    ):
        self.hf = tk
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos and bos_token_id is not None
        self.eos_token_ids = eos_token_ids
        #: the model's own EOS (tokenizer_config eos_token / tokenizer.ggml.eos_token_id), for templates
        self.eos_token_id = (
            eos_token_id if eos_token_id is not None else (min(eos_token_ids) if eos_token_ids else None)
        )
        self.chat_template = chat_template
        self.vocab_size = tk.get_vocab_size(with_added_tokens=True)
        self._segments = SegmentEncoder(tk)  # a prompt sent again (same scope) costs only its new pieces
        added = tk.get_added_tokens_decoder()
        specials = {t.content: i for i, t in added.items() if t.special and t.content}
        self._special_ids = specials
        self._special_strip = {
            t.content: (bool(t.lstrip), bool(t.rstrip)) for t in added.values() if t.special and t.content
        }
        self._special_re = (
            re.compile("(" + "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)) + ")")
            if specials
            else None
        )
        self._text_tk: tokenizers.Tokenizer | None = None  # a clone that reads special strings as text
        self._text_segments: SegmentEncoder | None = None  # its piece cache (escaped text)
        self._clone_lock = threading.Lock()

    def encode(self, text: str, add_special_tokens: bool = False, scope: Any = None) -> list[int]:
        """Token ids of ``text``; special-token strings in it map to their ids. BOS only if asked and wanted.
        ``scope``: whose piece cache to reuse (the server's tenant and cache salt; None: the default)."""
        ids = self._segments.encode(text, scope)
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)  # type: ignore[arg-type]
        return ids

    def escape_specials(self, text: str) -> str:
        """Untrusted text (message content) -> text in which no special token will be recognised by
        ``encode_chat``: each special-token string gets CONTENT_MARK after its first character."""
        if CONTENT_MARK in text:
            text = text.replace(CONTENT_MARK, CONTENT_MARK + CONTENT_MARK)
        if self._special_re is None:
            return text
        return self._special_re.sub(lambda m: m.group(0)[0] + CONTENT_MARK + m.group(0)[1:], text)

    def _text_tokenizer(self) -> tokenizers.Tokenizer:
        with self._clone_lock:
            if self._text_tk is None:
                tk = tokenizers.Tokenizer.from_str(self.hf.to_str())
                tk.encode_special_tokens = True
                self._text_tk = tk
                # whole pieces cached as they are (never cut: this clone reads special strings as text)
                self._text_segments = SegmentEncoder(tk, split=False)
            return self._text_tk

    def _encode_text(self, part: str, scope: Any = None) -> list[int]:
        """``part`` tokenised with special-token strings read as text, from ``scope``'s piece cache."""
        if self._text_segments is None:
            self._text_tokenizer()
        return self._text_segments.encode(part, scope)  # type: ignore[union-attr]

    def encode_chat(self, text: str, scope: Any = None) -> list[int]:
        """Ids of a rendered chat prompt: special tokens the template wrote become their ids; text
        escaped by ``escape_specials`` (and every other piece) is tokenised as plain text. Identical to
        ``encode`` when nothing was escaped. ``scope`` as for ``encode``."""
        if self._special_re is None or CONTENT_MARK not in text:
            return self.encode(text, scope=scope)  # nothing escaped: exactly the tokenizer's own splitting
        parts = self._special_re.split(text)
        for i in range(1, len(parts), 2):  # AddedToken lstrip/rstrip absorb neighbouring whitespace
            strip_l, strip_r = self._special_strip.get(parts[i], (False, False))
            if strip_l:
                parts[i - 1] = parts[i - 1].rstrip()
            if strip_r and i + 1 < len(parts):
                parts[i + 1] = parts[i + 1].lstrip()
        ids: list[int] = []
        for i, part in enumerate(parts):
            if i % 2:
                ids.append(self._special_ids[part])
            elif part:
                part = _MARK_RUN.sub(lambda m: CONTENT_MARK if len(m.group(0)) == 2 else "", part)
                ids.extend(self._encode_text(part, scope))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.hf.id_to_token(int(i))

    @property
    def bos_token(self) -> str:
        return (self.id_to_token(self.bos_token_id) or "") if self.bos_token_id is not None else ""

    @property
    def eos_token(self) -> str:
        return (self.id_to_token(self.eos_token_id) or "") if self.eos_token_id is not None else ""

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render the conversation with the model's template (ChatML when it has none)."""
        for k in ("bos_token", "eos_token"):  # the model's own, never the caller's
            if k in template_kwargs:
                raise MemraError(
                    f"chat template variable {k!r} cannot be set by the request", param=f"chat_template_kwargs.{k}"
                )
        return render_chat_template(  # other reserved names in template_kwargs are refused there
            self.chat_template,
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **template_kwargs,
        )

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens)


def _end_of_turn_ids(tk: tokenizers.Tokenizer) -> set[int]:
    specials = {t.content for t in tk.get_added_tokens_decoder().values() if t.special}
    return {tk.token_to_id(t) for t in END_OF_TURN_TOKENS if t in specials}


def _gguf_tokenizer(source: WeightSource) -> Tokenizer:
    md = source.metadata
    model = md.get("tokenizer.ggml.model")
    if model is None:
        raise MemraError(
            f"{source.path}: GGUF has no tokenizer (tokenizer.ggml.model missing)", code="invalid_model"
        )
    if model not in ("gpt2", "llama"):
        raise MemraError(
            f"{source.path}: GGUF tokenizer model {model!r} is not supported (byte-level BPE 'gpt2' and "
            "SentencePiece 'llama' are); use the HF checkpoint directory with tokenizer.json instead",
            code="invalid_model",
        )
    tokens: list[str] = md["tokenizer.ggml.tokens"]
    types: list[int] = md.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if model == "llama":
        scores = md.get("tokenizer.ggml.scores")
        if scores is None:
            raise MemraError(f"{source.path}: SentencePiece GGUF vocab without tokenizer.ggml.scores", code="invalid_model")
        tk = spm_tokenizer(
            tokens, scores, types, add_space_prefix=bool(md.get("tokenizer.ggml.add_space_prefix", True))
        )
    else:
        merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges", [])]
        pre = md.get("tokenizer.ggml.pre", "default")
        vocab: dict[str, int] = {}
        for i, t in enumerate(tokens):
            vocab.setdefault(t, i)
        tk = tokenizers.Tokenizer(
            models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in ("llama-bpe", "llama3"))
        )
        tk.pre_tokenizer = _pre_tokenizer(pre)
        tk.decoder = decoders.ByteLevel()
        added = [
            AddedToken(tokens[i], special=types[i] == 3, normalized=False)
            for i in range(len(tokens))
            if types[i] in (3, 4)
        ]
        tk.add_tokens(added)
    bos = md.get("tokenizer.ggml.bos_token_id")
    eos = {
        md[k]
        for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if k in md
    }
    eos |= _end_of_turn_ids(tk)
    return Tokenizer(
        tk,
        bos_token_id=bos,
        add_bos=bool(md.get("tokenizer.ggml.add_bos_token", False)),
        eos_token_ids=frozenset(int(e) for e in eos),
        eos_token_id=md.get("tokenizer.ggml.eos_token_id"),
        chat_template=md.get("tokenizer.chat_template"),
    )


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read JSON: {e}") from None


def _token_str(v: Any) -> str | None:
    return v.get("content") if isinstance(v, dict) else v


def _ids(v: Any) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in (v if isinstance(v, list) else [v])]


def _hf_tokenizer(source: WeightSource) -> Tokenizer:
    d = source.path
    tj = d / "tokenizer.json"
    if not tj.is_file():
        raise MemraError(
            f"{d}: no tokenizer.json (only HF fast tokenizers are supported)", code="invalid_model"
        )
    try:
        tk = tokenizers.Tokenizer.from_file(str(tj))
    except Exception as e:
        raise MemraError(f"{tj}: cannot load tokenizer: {e}", code="invalid_model") from None
    cfg = _json(d / "tokenizer_config.json") if (d / "tokenizer_config.json").is_file() else {}
    added = cfg.get("added_tokens_decoder") or {}
    missing = [
        AddedToken(v["content"], special=bool(v.get("special")), normalized=False)
        for v in added.values()
        if isinstance(v, dict) and tk.token_to_id(v.get("content", "")) is None
    ]
    if missing:
        tk.add_tokens(missing)
    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{name, template}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if (d / "chat_template.jinja").is_file():
        template = (d / "chat_template.jinja").read_text(encoding="utf-8")
    model_cfg = source.metadata
    bos_str = _token_str(cfg.get("bos_token"))
    bos = tk.token_to_id(bos_str) if bos_str else None
    if bos is None and model_cfg.get("bos_token_id") is not None:
        bos = int(model_cfg["bos_token_id"])
    if "add_bos_token" in cfg:
        add_bos = bool(cfg["add_bos_token"])
    else:  # a post-processor (e.g. Llama 3's TemplateProcessing) may add it
        probe = tk.encode("a", add_special_tokens=True).ids
        add_bos = bos is not None and bool(probe) and probe[0] == bos
    eos: set[int] = set()
    eos_str = _token_str(cfg.get("eos_token"))
    primary = tk.token_to_id(eos_str) if eos_str else None
    if primary is None and _ids(model_cfg.get("eos_token_id")):
        primary = _ids(model_cfg.get("eos_token_id"))[0]
    if primary is not None:
        eos.add(primary)
    eos |= set(_ids(model_cfg.get("eos_token_id")))
    eos |= set(_ids((model_cfg.get("_generation_config") or {}).get("eos_token_id")))
    eos |= _end_of_turn_ids(tk)
    return Tokenizer(
        tk,
        bos_token_id=bos,
        add_bos=add_bos,
        eos_token_ids=frozenset(eos),
        eos_token_id=primary,
        chat_template=template,
    )


def load_tokenizer(source: WeightSource) -> Tokenizer:
    """The tokenizer of ``source`` (GGUF: built from tokenizer.ggml.*; HF dir: tokenizer.json + configs)."""
    if source.format == "gguf":
        return _gguf_tokenizer(source)
    return _hf_tokenizer(source)
