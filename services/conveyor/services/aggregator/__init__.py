"""The aggregator: sharded gradient aggregation and parameter serving (DESIGN section 5)."""
