"""One module per experiment; each registers itself (benchmarks.lib.register). Heavy imports go inside run()."""
