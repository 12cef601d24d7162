"""Measurement: acceptance length and speedup against baselines (``evaluate``), reports (``report``), the
tree-budget search (``tune``) and the Serve load test (``loadtest``). May import: ``pipeline.serve``,
``pipeline.registry``, ``pipeline.resources``, ``pipeline.data.chat`` and the pipeline root. Entry points:
``evaluate.run_eval``, ``tune.run_tune_tree``, ``loadtest.run_bench_serve``."""
