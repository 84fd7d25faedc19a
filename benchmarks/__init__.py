"""Benchmarks of paged_kv_compile: paged vs dense time, compile cost, memory, metadata cost; a GPU suite.

Every module has ``main(argv) -> int`` (``--json`` prints machine-readable results, ``--quick`` a tiny
smoke run where it applies). ``python -m benchmarks.run_all`` runs the CPU benchmarks and regenerates
``docs/benchmarks.md``'s tables and figures.
"""
