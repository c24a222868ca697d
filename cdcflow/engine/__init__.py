"""The micro-batch engine: one batch loop for every runner."""
