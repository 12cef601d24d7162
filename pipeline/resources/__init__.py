"""What a run uses: its target (``targets``: assets, the tiny test target; ``identity``: its fingerprint
and the driver's view of it without weights; ``check_target``), its drafts
(``drafts``: the one resolver and lineage check) and evaluation questions (``questions``).
May import: griffin and the pipeline root (config, runtime, files). Entry points:
``targets.load_target``, ``drafts.load_draft_uri``, ``questions.load_questions``."""
