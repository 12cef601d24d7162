"""The GRIFFIN method as single-process PyTorch + transformers: configs, draft model, losses, training step,
draft tree, verification, decode loops, replay, the target adapter, checkpoint I/O and export formats.
May import: torch, transformers, safetensors, pydantic; never ray, mlflow or ``pipeline``."""
