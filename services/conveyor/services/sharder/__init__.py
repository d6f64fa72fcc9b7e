"""The sharder service: plans jobs and releases their shard tasks with flow control."""
