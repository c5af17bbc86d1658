"""Tensor parallelism: one model's layers split over the GPUs of one host (docs/scaling.md)."""
