"""Benchmarks (timings live here, not in tests). Scripts run as files; ``benchmarks.gpu`` is a package."""
