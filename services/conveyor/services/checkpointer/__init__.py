"""The checkpointer: commits the checkpoints the aggregators' slice owners write, applies
retention and runs the time trigger (DESIGN section 5)."""
