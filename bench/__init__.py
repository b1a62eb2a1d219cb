"""Side-by-side benchmarks of aserve against a plain aiohttp handler (issue 2).

``python -m bench.run`` runs everything and writes ``bench/RESULTS.md`` and
``bench/results.json``; ``python -m bench.loadgen`` is the load generator alone.
"""
