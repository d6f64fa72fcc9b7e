"""The trainer: joins a job, consumes its batches, computes gradients and trains through the
aggregator shards (the gradient plane); evaluates each epoch's eval batches."""
