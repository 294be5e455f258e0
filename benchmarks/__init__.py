"""aloepri's experiments: every figure the docs cite comes from one of them.

    python -m benchmarks list                       # experiments, their named configs, and what is stored
    python -m benchmarks run NAME [--config CONFIG] [--set FIELD=VALUE ... --save-as NEW]
    python -m benchmarks report NAME [--config CONFIG]
    python -m benchmarks render-docs [--check] [FILES]  # the docs' report blocks from the store (lib/docs.py)

Experiments live in ``benchmarks/experiments/`` (one module each, registered by name); the shared parts (results
store with provenance, typed config parsing, model names, cached obfuscated targets, engine servers) in
``benchmarks/lib/``. Results: ``benchmarks/results/<experiment>/<config>.json``.
"""
