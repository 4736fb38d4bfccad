"""Tests of the experiments (benchmarks, the zoo, claims, notebooks); the library's: tests/."""
