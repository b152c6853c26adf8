"""Model architectures: their specs read from GGUF metadata, their tensor tables, their graphs,
the host RoPE tables, and synthetic models in real layouts."""
