"""Model architectures as graphs, and synthetic models for tests and benchmarks."""
