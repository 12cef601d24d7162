"""Training data: conversations in (``sources``), the one chat renderer (``chat``), the parts runner
shared by featurize and regenerate (``parts``), the Parquet feature store (``store``, ``featurize``,
``part_files``: where its files live and what they are called, ``integrity``: their digests), the
held-out rows and their parts (``heldout``), tokenizing on Ray Data (``tokenized``) and regenerated
answers (``regenerate``). May import: ``pipeline.resources`` and the pipeline root. Entry points:
``featurize.run_featurize``, ``regenerate.run_regenerate``."""
