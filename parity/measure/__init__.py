"""Measurements of a loaded model: perplexity (llama.cpp's protocol) and speed (parity bench)."""
