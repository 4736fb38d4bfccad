"""The first thing a device run records: versions, device, and every `_compat` probe.

Runs the probes of `jact._compat.check()` (JAX and Flax accessors) one by one
(each one's outcome is kept, so one changed access does not hide the others)
and the kernel registry's choice per op, and writes them with the run's
metadata. Exit code 1 when a probe fails.

    python -m experiments.gpu.gpu_checks --json PATH
"""

from __future__ import annotations

import argparse
import sys

from experiments.lib import metadata, resumable

__all__ = ["probe_outcomes", "main"]


def probe_outcomes(probes: dict) -> dict:
  """`{name: "ok" or its error}` of each probe (a callable of no argument) in `probes`."""
  outcomes = {}
  for name, probe in probes.items():
    try:
      probe()
      outcomes[name] = "ok"
    except Exception as e:  # noqa: BLE001 - recorded: that is the point
      outcomes[name] = f"{type(e).__name__}: {str(e)[:400]}"
  return outcomes


def main(argv=None) -> int:
  p = argparse.ArgumentParser(
    prog="python -m experiments.gpu.gpu_checks", description=__doc__.splitlines()[0]
  )
  p.add_argument("--json", required=True)
  a = p.parse_args(argv)
  import jact.kernels
  from jact._compat import flax as flax_compat  # registers the Flax accessors' probes too

  checks = flax_compat.CHECKS
  jax_probes = probe_outcomes(
    {
      name: probe.run
      for name, probe in checks.items()
      if not probe.module.startswith("jact._compat.flax")
    }
  )
  flax_probes = probe_outcomes(
    {
      name: probe.run
      for name, probe in checks.items()
      if probe.module.startswith("jact._compat.flax")
    }
  )
  chosen = {op: jact.kernels.select(op).name for op in jact.kernels.REGISTRY.ops}
  out = {
    "meta": metadata.run_metadata("experiments.gpu.gpu_checks", argv),
    "python": sys.version.split()[0],
    "jax_compat": jax_probes,
    "flax_compat": flax_probes,
    "kernels_chosen": chosen,
    "kernels_available": {
      op: sorted(jact.kernels.available(op)) for op in jact.kernels.REGISTRY.ops
    },
  }
  failed = [n for n, v in {**jax_probes, **flax_probes}.items() if v != "ok"]
  out["all_ok"] = not failed
  resumable.write_json(a.json, out)
  print(
    f"compat probes: {len(jax_probes)} jax, {len(flax_probes)} flax; failed: {failed or 'none'}; "
    f"kernels chosen: {chosen}",
    flush=True,
  )
  return 1 if failed else 0


if __name__ == "__main__":
  raise SystemExit(main())
