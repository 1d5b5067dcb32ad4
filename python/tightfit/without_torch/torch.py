"""Found first on the PYTHONPATH of processes `fresh_process.children_without_torch` starts."""

raise ImportError("torch is left out of this tightfit worker process (fresh_process.py)")
