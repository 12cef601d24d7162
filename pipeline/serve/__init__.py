"""Ray Serve: the app builder (``app``) of two deployments, the HTTP edge (``ingress``, with its admission
and relayed calls in ``relay``, API keys in ``auth``) in front of the decoding deployment
(``deployment``); error answers (``errors``); starting and stopping it (``lifecycle``; the drain every ingress replica hears, ``drain``), the replica's
batching engine in its thread and a request's decode through it (``replica``), metrics
(``metrics``), the OpenAI wire protocol (``protocol``), the API fields refused by name (``fields``),
server-sent events (``sse``) and the registered model as an MLflow pyfunc (``pyfunc``). May import:
``pipeline.resources``, ``pipeline.data.chat`` and the pipeline root. Entry points: ``app.app_builder``,
``lifecycle.run_serve``."""


def __getattr__(name: str):
    """``pipeline.serve:app_builder`` also works as a Serve import path (resolved lazily: no Ray at import)."""
    if name == "app_builder":
        from pipeline.serve.app import app_builder

        return app_builder
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
