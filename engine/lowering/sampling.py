"""Lowering of the sampling tail on the logits (not a graph op: every plan ends with it).

``greedy``: argmax into out_ids (kernels/argmax.cu.j2); ``sample``: temperature / top-k / top-p /
min-p sampling (kernels/sample.cu.j2; greedy rows inside it take the argmax); ``penalised``: the
sparse penalties kernel in place on the logits, then ``sample``. Each kind also has a
``masked_<kind>`` twin that first runs kernels/token_mask.cu.j2 in place (per-row logit bias and a
constraint's allowed-token bitmask, rows flagged in fixed input buffers, so one captured graph
serves any mix of masked and unmasked rows), and a ``masked_<kind>_lp`` one that also ends with
kernels/logprobs.cu.j2 (log-softmax and top-k of the rows asking for logprobs, from the raw copy
token_mask keeps of them in the ``lp_raw`` scratch). Must not import CUDA or numpy."""

from __future__ import annotations

from engine.ir import LOGPROBS, LP_SLOTS, MASKED, PENALTY_CAPACITY, ROWS, Arg, Launch, ScratchPlan, Value, val
from engine.kernel_catalog import ELEMENTWISE_THREADS, LP_TOP, PENALTY_BLOCKS, SAMPLING_THREADS
from engine.types import ConfigError


def lower_sampling(ctx, logits: Value) -> dict[str, tuple[Launch, ...]]:
    t = SAMPLING_THREADS
    vocab = logits.width
    if logits.ld != vocab or logits.dtype != "f32":
        raise ConfigError("plan: the sampler needs contiguous f32 logits")
    amax = ctx.spec("argmax", vocab=vocab, ld=logits.ld, threads=t)
    samp = ctx.spec("sample", vocab=vocab, ld=logits.ld, threads=t)
    out = Arg("input", "out_ids")
    greedy = Launch(amax, ("n",), (t,), (out, val(logits), ROWS))
    inputs = tuple(Arg("input", n) for n in ("temperature", "top_k", "top_p", "min_p", "seeds", "counters"))
    sample = Launch(samp, ("n",), (t,), (out, val(logits)) + inputs + (ROWS,))
    et = ELEMENTWISE_THREADS
    pen = ctx.spec("penalties", ld=logits.ld, threads=et)
    pargs = (
        (val(logits), Arg("input", "pen_entries"))
        + tuple(Arg("input", n) for n in ("presence", "frequency", "repetition"))
        + (Arg("const", PENALTY_CAPACITY, "i32"),)
    )
    penalise = Launch(pen, (PENALTY_BLOCKS,), (et,), pargs)
    ctx.need_scratch(ScratchPlan("lp_raw", fixed=LP_SLOTS * vocab * 4))
    raw = Arg("scratch", "lp_raw")
    mspec = ctx.spec("token_mask", vocab=vocab, ld=logits.ld, threads=t)
    margs = tuple(Arg("input", n) for n in ("mask_slot", "bias_start", "bias_entries", "mask_words", "lp_slot"))
    mask = Launch(mspec, ("n",), (t,), (val(logits),) + margs + (raw, ROWS))
    lspec = ctx.spec("logprobs", vocab=vocab, threads=t, top=LP_TOP)
    largs = tuple(Arg("input", n) for n in ("lp_slot", "lp_k", "out_ids", "lp_ids", "lp_vals"))
    lp = Launch(lspec, ("n",), (t,), (raw,) + largs + (ROWS,))
    kinds = {"greedy": (greedy,), "sample": (sample,), "penalised": (penalise, sample)}
    masked = {MASKED + k: (mask,) + launches for k, launches in kinds.items()}
    return kinds | masked | {k + LOGPROBS: launches + (lp,) for k, launches in masked.items()}
