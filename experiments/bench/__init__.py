"""Benchmark harness: the jagged kernels against every peer, one command per suite.

``python -m experiments bench attention|dense_attention|ops|all|report`` (``cli``): shapes in
``suites``, peers in ``providers*``, the loop in ``runner``, timing in ``measure``, verdicts in
``targets``, tables in ``report``, figures in ``plots``."""
