"""Where experiments read and write: the repository root, `experiments/results/`, `runs/`."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "experiments" / "results"
RUNS = ROOT / "runs"
ACTNN_CIFAR_RUNS = RUNS / "actnn_cifar"  # checkpoints of experiments.papers.actnn_cifar
