"""tightfit's Relax passes, one a file; the order they run in is python/tightfit/pipeline.py."""
