"""Speculative decoding: a proposer guesses the next tokens of running sequences, the model
scores all of them in one step, and the longest prefix the model agrees with is kept
(engine/spec_decode/speculator.py says how, and why the output is unchanged)."""
