"""Speculative decoding: proposers (n-gram prompt lookup, draft model, MTP), the acceptance rule and
the engine-side glue that attaches drafts to decode rows and rolls rejected positions back.

Modules: ``config`` (the ``--speculative`` / ``--spec-tokens`` settings), ``proposer`` (the
Proposer protocol, prompt lookup, MTP), ``draft`` (a smaller checkpoint run through the Runner
protocol with its own KV), ``mtp_head`` (a family's MTP head in numpy with its own KV),
``hidden_tap`` (the target's hidden states per position, the MTP head's input), ``accept`` (greedy and rejection-sampling verification, numpy),
``policy`` (how many tokens to draft per row and step), ``speculator`` (what the engine loop
calls), ``build`` (CLI flags -> Speculator). See docs/speculative.md.
"""
