"""Checks and measurements that need a GPU (run by `python -m experiments.gpu_campaign`)."""
