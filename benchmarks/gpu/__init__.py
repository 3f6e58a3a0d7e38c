"""A prepared one-command GPU check (``bash benchmarks/gpu/run.sh``); see ``benchmarks/gpu/check.py``."""
