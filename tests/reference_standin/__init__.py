"""A tiny stand-in for the course's reference package cs336_basics (not installed here), written to its documented
layout (assignment2-systems 26.1.1, cs336-basics/cs336_basics): the module and parameter names of
BasicsTransformerLM, separate q/k/v projections, RoPE over feature pairs (2i, 2i + 1) with the rotated evens written
before the odds and its table computed in fp32, pre-norm blocks (ln1, ln2), SwiGLU w2(silu(w1 x) * w3 x), an
untied LM head; its cross_entropy a mean over every token; its AdamW torch's (the course's has the same update).
Used by tests/test_leaderboard.py as `Reference("reference_standin")`."""
