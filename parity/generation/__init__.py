"""Running a sequence: sessions over a KV cache, sampling, stop strings, streaming generation."""
