"""Measurement: acceptance length and speedup against baselines (``evaluate``, over the methods it
compares: ``methods``), reports (``report``), the tree-budget search (``tune``) and the serving
policy per batch size (``batch_policy``), and the Serve load test (``loadtest``, its reports:
``loadtest_report``). May import: ``pipeline.serve``,
``pipeline.registry``, ``pipeline.resources``, ``pipeline.data.chat`` and the pipeline root. Entry points:
``evaluate.run_eval``, ``tune.run_tune_tree``, ``loadtest.run_bench_serve``."""
