"""Data in: the job's batches as they reach this trainer. ``prefetch`` takes the records of the
batches topic, copies their tensors to the device ahead of the step loop and measures the data
wait that prefetch did not hide; ``batches`` keeps where each delivered batch stands (queued
to train or evaluate, held for its epoch, done, a copy) and acknowledges its records once the
control log shows its effect; ``intake`` joins the job's consumer group and puts the two
together (and drops the batches of partitions that moved to another trainer)."""
