"""The preprocessor service: shard tasks in, augmented uint8 micro-batches out."""
