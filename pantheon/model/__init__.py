"""Pure model functions: (params, state, inputs) -> (logits, state)."""
