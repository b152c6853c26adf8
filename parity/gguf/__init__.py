"""GGUF files: a bounded reader of the header with zero-copy tensor views, and a writer for the
small synthetic models the tests build."""
