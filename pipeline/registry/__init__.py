"""Drafts after training: MLflow registration with lineage and the promotion gate (``register``), exports
to other layouts, and shipped drafts under ``drafts/`` (``ship``). May import: ``pipeline.resources`` and the
pipeline root. Entry points: ``register.run_register``, ``register.run_export``, ``ship.run_ship``."""
