"""The GRIFFIN method as single-process PyTorch + transformers, a module a job.

- The draft: ``config`` (the typed configs), ``model`` (the draft), ``checkpoint`` (draft directories),
  ``weights`` (the draft I/O's stable entry points), ``export`` and ``export_layouts`` (other layouts,
  and their weight names as data).
- Training: ``losses`` (the token-alignable losses), ``training`` (optimizer, schedule, one step).
- The target: ``target`` (one adapter over the HF families), ``families`` (the families decoding is
  tested on, and the refusal of the others), ``target_files`` (its files and digests),
  ``target_parts`` (what a draft borrows, read without the target), ``assets`` (targets shipped on
  PyPI as GGUF files).
- Decoding: ``tree`` (draft trees), ``verify`` (lossless verification), ``engine`` (the batching
  engine), ``request`` (a request and its decode in progress), ``policy`` (the tree per batch
  size), ``rows`` (KV caches with a row per request), ``capacity`` (how many rows fit a device),
  ``static`` (compiled decoding), ``decode`` (one request's decode), ``results`` (what every decode
  returns and records), ``offline`` (decoding outside a server), ``replay`` (speculation replayed from the target's own continuation).

May import: torch, transformers, safetensors, pydantic; never ray, mlflow or ``pipeline``."""
