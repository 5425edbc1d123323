"""Runnable examples; `examples.mobilenet` and `examples.digits` are shared with tests and benchmarks."""
