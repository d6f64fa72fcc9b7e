"""The aggregator: gradient aggregation and parameter serving, the parameters cut into K slices
whose owners share the aggregator processes (DESIGN section 5)."""
