"""Benchmarks: `python -m sailfish.bench` (see __main__.py) and the config tuner (tune.py)."""
