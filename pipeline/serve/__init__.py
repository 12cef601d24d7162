"""Ray Serve: the deployment and app builder (``app``), the OpenAI wire protocol (``protocol``) and
server-sent events (``sse``). May import: ``pipeline.resources``, ``pipeline.data.chat`` and the pipeline
root. Entry points: ``app.app_builder``, ``app.run_serve``."""
