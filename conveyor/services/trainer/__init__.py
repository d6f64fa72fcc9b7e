"""The trainer: joins a job, consumes its batches, trains, checkpoints, reports (issue 3:
a single trainer runs the optimizer step itself)."""
