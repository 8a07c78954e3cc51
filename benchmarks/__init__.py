"""Benchmarks: step time, communication and memory per rank, against peers (see docs/benchmarks.md)."""
