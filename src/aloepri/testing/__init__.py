"""Tiny and synthetic models for tests and benchmarks (no downloads)."""
