"""The training domain shared by services: the job spec and its plan, datasets, models, the
flat parameter layout and its slices, optimizers, compression, partition routing and the
job-state view folded from the jobs topic. Builds on :mod:`conveyor.platform`, never on a
service."""
