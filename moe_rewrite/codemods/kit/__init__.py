"""What the codemods share: the prover of published code (prove.py)."""
