"""Token-alignable training on Ray Train: the driver (``driver``: TorchTrainer per stage, checkpoints,
MLflow), the per-worker loop (``worker``) and what the driver hands it (``job``), the stage's inputs:
its parts and held-out rows (``inputs``), the one stream that spans a stage's epochs (``stream``), the
channel the driver and the ranks of a stage share (``channel``: where the stream starts, the console's
progress), each rank's micro-batches packed from its own rows (``batches``), bounded retries of real
crashes (``failures``) and the checkpoint on a preemption notice (``preemption``). May import:
``pipeline.data``, ``pipeline.resources`` and the pipeline root. Entry point: ``driver.run_train``."""
