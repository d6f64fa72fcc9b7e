"""The trainer: joins a job, consumes its batches, computes gradients and trains through the
aggregators' slice owners (the gradient plane); evaluates each epoch's eval batches."""
