"""Benchmark harness: jagged kernels against every peer, one command per suite.

``python -m experiments bench attention|dense_attention|ops|all --suite paper|recsys|long|smoke``
prints provider-by-shape tables (forward ms, forward+backward ms, peak memory with inputs in
each provider's own layout, useful TFLOP/s or GB/s, speed and memory relative to ours), writes
the rows as JSON and regenerates ``experiments/results/kernels-<gpu>.md`` with the plots.
``python -m experiments bench report --out DIR`` rebuilds the tables and plots from DIR's JSON.

Modules: ``suites`` (shapes, lengths, FLOP formulas), ``layouts`` (inputs, padding,
fp32 references), ``providers*`` (ours and the peers, each in its own layout), ``measure``
(timing, memory, ceilings), ``runner`` (the loop), ``targets``, ``report``, ``plots``, ``stamp``;
``sweep`` and ``costmodel`` (launch configs); ``gpu_check`` (every kernel compiled for a GPU
target, no GPU needed).
"""
