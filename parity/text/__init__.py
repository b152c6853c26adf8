"""Text in and out of a model: the tokenizer from GGUF metadata and sandboxed chat templates."""
