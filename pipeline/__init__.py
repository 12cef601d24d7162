"""The pipeline around the method: Ray, MLflow, files and the ``griffin`` command.

Stages are packages, each importing only downward: ``resources`` (targets, drafts, questions) <- ``data``
(conversations, features) <- ``train``; ``registry``; ``serve`` <- ``evaluate``. The root holds what every
stage shares (``config``, ``console``, ``runtime``, ``files``, ``lock``: one writer per run directory)
and what runs them (``cli``, ``run``, ``submit``). ``tests/test_architecture.py`` checks these rules.
"""
