"""Helpers for tests and benchmarks that run the pinned SGLang on machines lacking its GPU kernel packages."""
