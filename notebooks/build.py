"""Writes the experiment notebooks 02-07 and executes them (and the quickstart) in place.

Each notebook states a paper's claim, shows the committed full-run results
from `experiments/results/` (tables and plots), and re-runs a small version
live. Markdown cells are templates: every figure is `{{name}}`, filled from
the results JSON by `experiments.claims` when the notebook is written. Execution stores the outputs
in the .ipynb, so a reader sees the figures without running anything:

    python notebooks/build.py                 # write 02-07, execute all seven
    python notebooks/build.py --only 02 05    # some of them
    python notebooks/build.py --no-execute    # write the cells only

The test suite executes every notebook (tests/test_notebook.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from experiments import claims  # noqa: E402  (prose figures come from the results JSON)

SETUP = """\
import json, sys, tempfile
from pathlib import Path

# experiments/ is not installed with jact: put the repository root on the path.
ROOT = next(p for p in (Path.cwd(), *Path.cwd().parents)
            if (p / "experiments" / "__init__.py").is_file())
sys.path.insert(0, str(ROOT))
%matplotlib inline
import matplotlib.pyplot as plt
from IPython.display import Image, Markdown, display

from experiments.lib import notebook_support as ns

RESULTS = ROOT / "experiments" / "results"
# the live small runs write here, not into the repository
SMALL = Path(tempfile.mkdtemp(prefix="jact_small_"))"""


def _small_actnn_run(*variants: str) -> str:
  """The live cell of notebooks 02 and 04: `variants` of actnn_cifar at small size."""
  names = ", ".join(f'"{v}"' for v in variants)
  return f"""\
from experiments.papers import actnn_cifar
actnn_cifar.main(["--variants", {names}, "--dataset", "cifar10", "--epochs", "1",
                  "--batch", "64", "--train-size", "512", "--test-size", "500", "--widths", "8",
                  "--blocks", "1", "--runs", str(SMALL / "runs"), "--results", str(SMALL)])
display(Markdown(ns.actnn_table(ns.load_variants(SMALL), [{names}])))"""


NOTEBOOKS = {
  "02_actnn_cifar": [
    (
      "markdown",
      """\
# ActNN on CIFAR-10: does 2-bit training match full precision?

**Claim (ActNN, Chen et al. 2021).** Storing every activation at 2 bits with per-group stochastic
rounding trains a CIFAR ResNet to the accuracy of full precision, and the adaptive L3 (2 bits on
average, per-layer and per-sample widths) does at least as well. Its theory says why: the gradient
stays unbiased and the added variance is small next to minibatch sampling noise (Fig. 5).

**What ran here.** `python -m experiments.papers.actnn_cifar --epochs 3`: the pre-activation
ResNet-20 (16/32/64 channels) on the full 50k CIFAR-10 training set, SGD with Nesterov momentum,
warm-up and cosine schedule, batch 128, random crops and flips, **3 epochs per variant** (about an
hour each on the 2-core CPU this project runs on), every variant from the same initialization with
the same batches. ActNN trains 200 epochs on a GPU: this is a short-schedule check, not the paper's
accuracy.""",
    ),
    ("code", SETUP),
    ("markdown", "## Test accuracy and memory per variant (full runs)"),
    (
      "code",
      """\
runs = ns.load_variants(RESULTS / "actnn_cifar")
display(Markdown(ns.actnn_table(runs, ns.ACTNN_MAIN)))
ns.accuracy_curves(runs, ns.ACTNN_MAIN, "ResNet-20, CIFAR-10 (full runs, CPU)");""",
    ),
    (
      "markdown",
      """\
## Gradient variance against bits (ActNN Fig. 5)

`python -m experiments.papers.grad_variance`: at the full-precision run's parameters after each
epoch, the summed variance of the exact gradient over 16 minibatches of 128 (dashed: sampling
noise) and the variance the compression adds for one fixed minibatch over 8 rounding seeds.""",
    ),
    (
      "code",
      'ns.show_figure(RESULTS / "grad_variance.png")\n'
      'display(Markdown(ns.variance_table(RESULTS / "grad_variance.json")))',
    ),
    (
      "markdown",
      """\
**What the runs say.** Over {{seeds.fp.n}} seeds full precision reaches {{seeds.fp.mean}} ±
{{seeds.fp.std}} test accuracy and uniform 2 bits {{seeds.pergroup2.mean}} ±
{{seeds.pergroup2.std}} (a {{seeds.gap_points}}-point gap; the largest seed-to-seed standard
deviation is {{seeds.largest_std_points}} points), keeping {{actnn.pergroup2.fewer_than_layers}}
fewer bytes than one float32 copy per layer input ({{actnn.pergroup2.fewer}} fewer than plain
JAX); 4 bits (ActNN L2) reaches {{actnn.actnn_l2.accuracy}}. The compression variance falls by the
predicted (2^b - 1)^-2 factor (1 -> 2 bits {{gv.0.fall_1_2}}, 2 -> 4 bits {{gv.0.fall_2_4}},
4 -> 8 bits {{gv.0.fall_4_8}}) and at 2 bits is {{gv.0.uniform2.over_sampling}},
{{gv.1.uniform2.over_sampling}} and {{gv.3.uniform2.over_sampling}} times the sampling variance,
so "2 bits add little next to sampling noise" holds. ActNN L3, with ActNN's rule that a batch
norm takes the width of the conv before it, gives {{gv.0.actnn_l3.over_uniform2}},
{{gv.1.actnn_l3.over_uniform2}} and {{gv.3.actnn_l3.over_uniform2}} of uniform 2 bits'
compression variance and reaches {{actnn.actnn_l3.accuracy}} (last-epoch training loss
{{actnn.actnn_l3.last_epoch_loss}} vs {{actnn.pergroup2.last_epoch_loss}} for uniform 2 bits on
the same batches).""",
    ),
    (
      "markdown",
      """\
## Re-run a small version live

A tiny ResNet (one stage of 8 channels, one block) for one epoch of 512 images of the kit's
CIFAR-10 subset: the same code path as the full run, a minute instead of hours. Its accuracy means
nothing; that it runs, and the memory columns, do.""",
    ),
    ("code", _small_actnn_run("fp", "actnn_l3")),
  ],
  "03_gact_transformer_gnn": [
    (
      "markdown",
      """\
# GACT on a transformer and a GNN, with no layer rewrite

**Claim (GACT, Liu et al. 2022).** Compression applied to an unmodified model by tracing it
(`jact.compressed`, `jact.convert` here) trains transformers and GNNs at 4 bits on average with
adaptive per-tensor widths as well as full precision; fixed low widths can hurt some layers (GAT),
and the adaptive plan recovers.

**What ran here.** `python -m experiments.papers.gact_tasks`: a small transformer classifier on
SST-2, a character-level LM on tiny Shakespeare, and a GCN and a GAT on Cora, ordinary Flax code
with jact applied from outside. The scale (steps, widths) is in each task's record below; CPU
only.""",
    ),
    ("code", SETUP),
    ("markdown", "## Results per task (full runs)"),
    (
      "code",
      """\
tasks = ns.load_variants(RESULTS / "gact")
display(Markdown(ns.gact_table(tasks)))
ns.loss_curves(tasks, "GACT tasks (full runs, CPU)");""",
    ),
    (
      "markdown",
      """\
**What the runs say.** GACT's "4 bits adaptive ≈ full precision" holds on every task: SST-2 final
test accuracy (the table's "final test accuracy"; "best held-out" is the dev set's)
{{gact.sst2.gact_l1.metric}} (L1, {{gact.sst2.gact_l1.bits}} bits on average) and
{{gact.sst2.gact_cb1.metric}} (CB1) vs {{gact.sst2.fp.metric}}, with {{gact.sst2.gact_l1.fewer}}
and {{gact.sst2.gact_cb1.fewer}} fewer bytes kept for the backward pass; the char LM's held-out
loss {{gact.shakespeare.gact_l1.metric}} vs {{gact.shakespeare.fp.metric}}. Fixed against adaptive
at the same average: fixed 4 bits {{gact.sst2.fixed4.metric}} (SST-2) and
{{gact.shakespeare.fixed4.metric}} (LM); fixed 2 bits {{gact.sst2.fixed2.metric}} and
{{gact.shakespeare.fixed2.metric}} against adaptive 2 bits {{gact.sst2.adaptive2.metric}} and
{{gact.shakespeare.adaptive2.metric}}. On Cora every variant is close to full precision (GAT
{{gact.cora_gat.fp.metric}} / {{gact.cora_gat.fixed4.metric}} fixed 4 bits), so "fixed low bits
degrade GAT" is not reproduced at 4 fixed bits. One seed each.""",
    ),
    (
      "markdown",
      """\
## Re-run a small version live

The GCN on Cora, plain and with every residual at 4 bits, for a few epochs (`--small` sizes): the
same code path as the full run. `python -m experiments.papers.gact_tasks --small` runs every task
and variant small (a few minutes: each adaptive variant compiles the numeric estimator).""",
    ),
    (
      "code",
      """\
from experiments.papers import gact_tasks
gact_tasks.main(["--small", "--tasks", "cora_gcn", "--variants", "fp", "fixed4",
                 "--results", str(SMALL)])
small = ns.load_variants(SMALL)
display(Markdown(ns.gact_table(small)))
ns.loss_curves(small, "Cora GCN, small live run");""",
    ),
  ],
  "04_blpa_division_acgc": [
    (
      "markdown",
      """\
# BLPA, DIVISION and AC-GC on the same ResNet

**Claims.** BLPA (Chakrabarti & Moseley 2019) keeps a 4-bit pre-ReLU copy per BN-ReLU-conv unit and
reports no accuracy loss at 4 bits but a drop below. DIVISION (Wang et al. 2022) stores an
8x8-block low-pass part plus a 2-bit high-frequency part and matches full precision. AC-GC (Evans &
Aamodt 2021) derives each layer's width from an allowed loss increase e^2.

**What ran here.** The same `experiments.papers.actnn_cifar` runs as notebook 02 (ResNet-20, full
CIFAR-10, 3 epochs, same init and batches), variants `blpa4`, `blpa2`, `division`, `acgc` (AC-GC's
AutoQuant: round-to-nearest fixed point at the widths of its Table 1 bounds, e^2 =
{{acgc.paper_error}}), `acgc_scale` (the same with the batch norms' scale gradients bounded too),
and `python -m experiments.papers.acgc_sweep`: the widths and compression the
bounds give for every e^2, at initialization and after 3 epochs.""",
    ),
    ("code", SETUP),
    ("markdown", "## Test accuracy and memory (full runs)"),
    (
      "code",
      """\
runs = ns.load_variants(RESULTS / "actnn_cifar")
display(Markdown(ns.actnn_table(runs, ns.OTHER_METHODS)))
ns.accuracy_curves(runs, ns.OTHER_METHODS, "BLPA / DIVISION / AC-GC vs FP (full runs, CPU)");""",
    ),
    (
      "markdown",
      """\
## AC-GC: what each e^2 asks for (`python -m experiments.papers.acgc_sweep`)

Widths from Table 1's bounds (statistics averaged over ten minibatches of 128), at the
initialization and at a full-precision run's parameters after 3 epochs; compression against
float32, from the widths, with jact's fixed point (every width 2 to 16 bits, each stored in exactly
its bits; wider needs kept exact), with any width up to 16 bits (the same), and with the paper's
AutoQuantZ accounting (a 1-bit zero mask plus the non-zeros).""",
    ),
    ("code", 'display(Markdown(ns.acgc_sweep_table(RESULTS / "acgc_sweep.json")))'),
    (
      "markdown",
      """\
Measured at e^2 = {{acgc.paper_error}}: the bytes the train step saves for the backward pass
(`jact.residual_report` under the plan) in the 36 bounded residuals, against float32, for AC-GC's
plan, for the same plan at the widths jact had before (2, 4, 8; wider kept exact) and for
AutoQuantZ (the convolution inputs in `ZeroValue(Fixpoint(b))`, capacity the largest non-zero
fraction seen, rounded up to 1/64; after 3 epochs, from the statistics the earlier run kept: the
mean fraction + 1/64).""",
    ),
    ("code", 'display(Markdown(ns.acgc_stored_table(RESULTS / "acgc_sweep.json")))'),
    (
      "markdown",
      """\
**What the runs say** (one seed each; FP reaches {{actnn.fp.accuracy}}, and {{seeds.fp.mean}} ±
{{seeds.fp.std}} over {{seeds.fp.n}} seeds). BLPA at 4 bits reaches {{actnn.blpa4.accuracy}}
keeping {{actnn.blpa4.fewer_than_layers}} fewer bytes than float32 layer inputs; at 2 bits it
keeps the fewest ({{actnn.blpa2.fewer_than_layers}} fewer) and reaches {{actnn.blpa2.accuracy}}:
the paper's "4 bits lossless, below that BLPA degrades" holds. DIVISION reaches
{{actnn.division.accuracy}} ({{actnn.division.fewer_than_layers}} fewer). AC-GC at e^2 =
{{acgc.paper_error}} asks for {{acgc.init.conv_bits}} bits on the convolution inputs and
{{acgc.init.norm_bits}} on the batch norms; jact's fixed point stores each of these widths in
exactly its bits, so {{acgc.init.stored.acgc.exact}} residuals stay exact and the measured
compression of the bounded residuals is {{acgc.init.stored.acgc}} ({{acgc.trained.stored.acgc}}
trained; {{acgc.init.stored.acgc_248}} with the widths 2, 4, 8 alone, which kept
{{acgc.init.stored.acgc_248.exact}} exact) and, with zero-value compression of the ReLU outputs
(the paper's AutoQuantZ), {{acgc.init.stored.autoquantz}} ({{acgc.trained.stored.autoquantz}}
trained): next to the paper's {{paper.acgc.autoquantz_average}}. The
run reaches {{actnn.acgc.accuracy}} keeping {{actnn.acgc.fewer_than_layers}} fewer bytes. Table 1
leaves the batch norms' scale gradients unbounded; `acgc_scale` bounds them too
(`scale_bound=True`) and reaches {{actnn.acgc_scale.accuracy}} keeping
{{actnn.acgc_scale.fewer_than_layers}} fewer bytes.""",
    ),
    ("markdown", "## Re-run a small version live"),
    ("code", _small_actnn_run("blpa2", "division")),
  ],
  "05_memory_and_speed": [
    (
      "markdown",
      """\
# What memory buys: batch size and step time

**Claim (all five papers).** With activations stored at 2-4 bits the same device fits a several
times larger batch, for a modest step-time cost.

**What ran here.** `python -m experiments.bench.memory_batch`: for the ResNet-20 and the zoo's
transformer LM, the largest batch whose real train step stays under a fixed cap (512 MiB) on the
peak RSS the running step adds on this CPU (each probe a fresh process), for plain JAX,
`jax.checkpoint`, jact 4 and 2 bits and `jact.checkpoint` (host offload: unsupported on CPU, where
every memory kind is the same RAM); and step time vs plain at equal batch (median of 20
interleaved steps, same run). `experiments/results/bench_memory.json` adds
compiled-memory figures for larger models.""",
    ),
    ("code", SETUP),
    ("markdown", "## Largest batch under the cap, and step time (full run)"),
    (
      "code",
      """\
display(Markdown(ns.memory_batch_table(RESULTS / "memory_batch.json")))
for png in sorted(RESULTS.glob("memory_batch_*.png")):
    if "small" not in png.name:
        ns.show_figure(png)""",
    ),
    (
      "markdown",
      """\
## Both caps: the step alone, and the step plus its compiled program

The cap above counts the memory the running step adds; the compiled program (code and constants)
comes on top, and jact's programs are larger. The same search capping the step plus the program
(`python -m experiments.bench.memory_batch --cap-on with_program_mib`):""",
    ),
    (
      "code",
      """display(Markdown(ns.both_caps_table(
    RESULTS / "memory_batch.json", RESULTS / "memory_batch_program" / "memory_batch.json")))""",
    ),
    (
      "markdown",
      """\
**What the run says.** Under the same {{mb.cap_mib}} MiB cap the ResNet-20 trains at batch
{{mb.resnet20.jact4.batch}} with 4-bit residuals and {{mb.resnet20.jact2.batch}} with 2-bit ones,
against {{mb.resnet20.plain.batch}} plain ({{mb.resnet20.jact4.times}},
{{mb.resnet20.jact2.times}}); the char LM at {{mb.transformer_lm.jact4.batch}} and
{{mb.transformer_lm.jact2.batch}} against {{mb.transformer_lm.plain.batch}}
({{mb.transformer_lm.jact4.times}}, {{mb.transformer_lm.jact2.times}}). `jax.checkpoint` of every
block buys nothing here, because XLA:CPU does not realize remat's saving (it merges the
recomputation with the forward pass); on XLA:GPU per-block remat is the baseline to beat
(notebook 08 compares the two there). Counting the compiled program too (the second table) the
gains shrink: ResNet-20 {{mbp.resnet20.jact4.times}} and
{{mbp.resnet20.jact2.times}}, char LM
{{mbp.transformer_lm.jact4.times}} and {{mbp.transformer_lm.jact2.times}}, and the ResNet's
`jact.checkpoint` program alone ({{mbp.resnet20.jact_checkpoint.program_mib}} MiB) exceeds the
cap. Two bits buy little over four because the backward pass's working
memory (one layer's decompressed activation and its gradients at a time) is not compressed. At
equal batch the jact step costs {{mb.resnet20.jact4.step_ratio}} (ResNet) and
{{mb.transformer_lm.jact4.step_ratio}} (LM) of plain at 4 bits on this CPU, measured with other
runs in the background.""",
    ),
    ("markdown", "## Compiled memory of larger models (earlier benchmark)"),
    ("code", 'display(Markdown(ns.bench_memory_table(RESULTS / "bench_memory.json")))'),
    (
      "markdown",
      """\
## Re-run a small version live

A tiny ResNet under a 40 MiB cap, compiled with LLVM's optimizations off (`--small`: quick
compiles, slower code), so its step-time ratio says nothing about the full run's above; it checks
that the search and the measurements run.""",
    ),
    (
      "code",
      """\
from experiments.bench import memory_batch
memory_batch.main(["--small", "--results", str(SMALL)])
display(Markdown(ns.memory_batch_table(SMALL / "memory_batch_small.json")))
for png in sorted(SMALL.glob("memory_batch_small_*.png")):
    ns.show_figure(png)""",
    ),
  ],
  "06_bit_plans": [
    (
      "markdown",
      """\
# Bit plans at work

**Claim (ActNN Sec. 4, GACT Sec. 4).** A sensitivity estimate per layer (ActNN: closed form; GACT:
numeric, from gradient differences) lets an allocator give more bits where the gradient is
sensitive and fewer elsewhere, at a fixed average, for a fraction of a training step.

**What ran here.** `python -m experiments.papers.bit_plans`: the widths both estimators choose at 2
bits average on the ResNet-20 (at the full-precision run's epoch snapshots) and on a character
transformer while it trains, and each estimator's cost in train steps.
`experiments.bench.bench_plans` measures the variance each plan gives.""",
    ),
    ("code", SETUP),
    ("markdown", "## Widths per residual over training (full run)"),
    (
      "code",
      """\
for png in sorted(RESULTS.glob("bit_plans_*.png")):
    if "small" not in png.name:
        ns.show_figure(png)
display(Markdown(ns.plan_cost_table(RESULTS / "bit_plans.json")))""",
    ),
    ("markdown", "## Variance each plan gives (bench_plans)"),
    ("code", 'display(Markdown(ns.bench_plans_table(RESULTS / "bench_plans.json")))'),
    (
      "markdown",
      """\
**What the runs say.** Adaptive plans pay off where residuals differ a lot in sensitivity: on the
small CNN at 2 bits the numeric and analytic plans give {{bp.cifar_cnn.gact_numeric2.variance}}
and {{bp.cifar_cnn.actnn_analytic2.variance}} against {{bp.cifar_cnn.uniform2.variance}} for
uniform (the dense head's input dominates). On the ResNet-20 (`grad_variance`'s plans after
epoch 3) the numeric estimator gives {{gv.3.gact_numeric.at_budget}} residuals the average width,
2 bits, and the analytic one, where batch norms take their conv's width,
{{gv.3.actnn_l3.at_budget}}. An
update costs {{bp.cifar_cnn.analytic_cost}} (CNN) and {{bp.shakespeare_transformer.analytic_cost}}
(transformer) train steps for the analytic estimator and {{bp.cifar_cnn.numeric_cost}} and
{{bp.shakespeare_transformer.numeric_cost}} for the numeric one (one gradient per residual;
measured with other jobs on the cores), so the numeric one wants infrequent re-plans on CPU.""",
    ),
    ("markdown", "## Re-run a small version live"),
    (
      "code",
      """\
from experiments.papers import bit_plans
bit_plans.main(["--small", "--models", "transformer", "--results", str(SMALL)])
ns.show_figure(SMALL / "bit_plans_small_transformer.png")""",
    ),
  ],
  "07_fit": [
    (
      "markdown",
      """\
# Tell jact how much memory you have: `jact.fit`

**The question users ask.** "My step needs 70 GiB and the card has 40." `jact.fit(loss_fn,
*example_args, budget_bytes=N)` answers it: bits per residual and which `jact.segment`s to
rematerialize (compressed remat), such that the *compiled* peak of the gradient step (XLA's memory
analysis) is within the budget, choosing the least predicted gradient variance, then the least
recomputation.

**What ran here.** `python -m experiments.bench.bench_fit`: an 8-block transformer LM written in
plain JAX with its blocks marked as segments, the zoo's linen LM and ResNet-50 at 224x224 (both
through `jact.convert`), at 1/2 to 1/12 of the plain step's compiled peak, against the best
uniform width that fits, with the gradient variance measured over rounding keys.""",
    ),
    ("code", SETUP),
    ("markdown", "## Budgets against uniform widths (full run)"),
    (
      "code",
      """\
from experiments.lib import fit_demo
display(Markdown(fit_demo.bench_table(RESULTS / "bench_fit.json")))""",
    ),
    ("markdown", "## Live: a model whose plain step does not fit, fitted and trained"),
    (
      "code",
      """\
run = fit_demo.demo(fraction=3, steps=60, batch=16, length=64, d=64, blocks=2)
mib = lambda b: f"{b / 2**20:.1f} MiB"
print(f"plain step: {mib(run['plain_peak'])} compiled; budget {mib(run['budget'])}")
print(run["fit"].report())""",
    ),
    (
      "code",
      """\
plt.figure(figsize=(6, 3.5))
plt.plot(run["plain_curve"], label=f"plain ({run['plain_peak'] / 2**20:.1f} MiB)")
plt.plot(run["fit_curve"], label=f"jact.fit ({run['fit'].peak_bytes / 2**20:.1f} MiB)")
plt.xlabel("step"); plt.ylabel("training loss"); plt.legend(); plt.title("tiny Shakespeare")
plt.show()""",
    ),
  ],
  "08_frontier": [
    (
      "markdown",
      """\
# Judged where users judge it: jact on XLA:GPU against JAX's own remat and offload

**The question users ask.** A JAX user short of device memory already has `jax.checkpoint` with a
policy (per-block remat, `dots_saveable`, MaxText-style named saves, host offload) for free. jact
is worth it only where it fits in less memory, or runs faster, than the best of those.

**Why not on this CPU.** XLA:CPU does not realize what `jax.checkpoint` saves (it merges the
recomputation with the forward pass), so CPU comparisons with remat flatter jact. Every figure here
is XLA:GPU's own compiled program for an H200, compiled on a CPU machine without a GPU
(`jact.compile_for(step, *args, target="h200")`): its buffer assignment gives the peak, and the
step time is **predicted** from the compiled program (a roofline calibrated on H200
measurements, `experiments/results/time_model.json`), never measured here.

**What ran here.** `python -m experiments.bench.frontier`: the gradient step of each model at real
size (compile-only: nothing is allocated) in every configuration, with attention as written and
as cuDNN's fused attention (`jax.nn.dot_product_attention(..., implementation="cudnn")`).""",
    ),
    ("code", SETUP),
    ("markdown", "## Each model's frontier (full run)"),
    (
      "code",
      """\
from experiments.lib import frontier_report as fr
frontier = fr.load(RESULTS / "frontier.json")
shown = [(m, a) for m, a in dict.fromkeys((r["model"], r["attention"]) for r in frontier["rows"])]
fig, axes = plt.subplots(len(shown), 1, figsize=(7, 3.6 * len(shown)))
for ax, (model, attention) in zip(list(getattr(axes, "flat", [axes])), shown):
  fr.plot(frontier, model, attention, ax)
fig.tight_layout(); plt.show()""",
    ),
    (
      "code",
      """\
for model, attention in shown:
  display(Markdown(fr.table(frontier, model, attention)))
display(Markdown(fr.summary_line(frontier)))""",
    ),
    ("markdown", "## Live: a small LM compiled for an H200 on this machine"),
    (
      "code",
      """\
import logging, os
# On a machine without CUDA the CUDA plugin logs a traceback when JAX starts ("Unable to load
# CUDA"); compiling for the H200 works regardless (jact registers the plugin itself).
logging.getLogger("jax._src.xla_bridge").setLevel(logging.CRITICAL)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
from experiments.bench import frontier as bench
small = bench.main(["--small", "--models", "lm_6x512", "--attention", "xla", "--configs",
                    "plain", "remat_nothing", "jact2", "jact_ckpt2", "--fit",
                    "--json", str(SMALL / "frontier.json")])
display(Markdown(fr.table(small, "lm_6x512", "xla")))""",
    ),
  ],
}


def write(name: str, cells) -> Path:
  nb = nbformat.v4.new_notebook()
  nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
  nb.metadata["language_info"] = {"name": "python"}
  make = {
    "markdown": lambda text: nbformat.v4.new_markdown_cell(claims.render(text)),
    "code": nbformat.v4.new_code_cell,
  }
  nb.cells = [make[kind](source) for kind, source in cells]
  path = HERE / f"{name}.ipynb"
  nbformat.write(nb, path)
  return path


def execute(path: Path, timeout: int = 1800) -> None:
  nb = nbformat.read(path, as_version=4)
  NotebookClient(
    nb, kernel_name="python3", timeout=timeout, resources={"metadata": {"path": str(HERE)}}
  ).execute()
  nbformat.write(nb, path)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--only", nargs="+", default=None, help="notebook number prefixes (01 .. 07)")
  p.add_argument("--no-execute", action="store_true")
  a = p.parse_args(argv)
  chosen = lambda name: a.only is None or name[:2] in a.only
  paths = [write(name, cells) for name, cells in NOTEBOOKS.items() if chosen(name)]
  if chosen("01_quickstart"):
    paths.insert(0, HERE / "01_quickstart.ipynb")
  if not a.no_execute:
    for path in paths:
      print("executing", path.name, flush=True)
      execute(path)


if __name__ == "__main__":
  main()
