"""Benchmarks: tvmgraph against torch eager and torch.compile, measured side by side."""
