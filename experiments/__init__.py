"""Experiments for jact: real-data loaders, Flax models written once for plain
and compressed layers, and the main comparison job (`python -m experiments.compare`)."""
