"""Token-alignable training on Ray Train: the driver (``driver``: TorchTrainer per stage, checkpoints,
MLflow), the per-worker loop and deterministic batches (``batches``). May import: ``pipeline.data``,
``pipeline.resources`` and the pipeline root. Entry point: ``driver.run_train``."""
