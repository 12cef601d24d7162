"""Thin ``ray job submit`` entry points (``python -m jobs.<stage> -c CONFIG``) and ``jobs/configs/*.yaml``.
May import: ``pipeline``."""
