"""Measurements of jact itself: memory, compile time, gradient error, kernels and train steps."""
