"""Real inference engines for sluice's own tests and benchmarks (``make test-real``): built from registry packages, cached."""
