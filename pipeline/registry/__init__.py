"""Drafts after training: MLflow registration with lineage and the promotion gate (``register``), exports
to other layouts (``export``) and shipped drafts under ``drafts/`` (``ship``). May import:
``pipeline.resources`` and the pipeline root. Entry points: ``register.run_register``,
``export.run_export``, ``ship.run_ship``."""


def __getattr__(name: str):
    """``pipeline.registry.DraftPyfunc``: the name under which MLflow stores registered with an earlier
    layout pickled the registered model's class (resolved lazily, so importing the package stays light)."""
    if name == "DraftPyfunc":
        from pipeline.registry.register import DraftPyfunc

        return DraftPyfunc
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
