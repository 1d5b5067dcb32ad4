"""Models and helpers for tests and benchmarks, built from code (nothing is downloaded)."""
