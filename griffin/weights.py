"""The draft I/O's former home, kept because ``griffin.weights.load_draft(path, target)`` and
``save_draft(draft, path)`` are stable entry points that users' code imports. Checkpoint I/O lives in
``griffin.checkpoint`` and the export layouts in ``griffin.export``; import from there."""

from griffin.checkpoint import load_draft, save_draft

__all__ = ["load_draft", "save_draft"]
