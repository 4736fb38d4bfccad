"""The probe machinery every `jact._compat` module shares.

Each accessor of a `jact._compat` module has a probe beside it, registered with
`@probes(accessor="what it reads")`; `check()` runs probes and raises one
`CompatError` naming every access the installed JAX or Flax changed, so an
upgrade fails in one place, by name, instead of deep inside a transform.
"""

from __future__ import annotations

import sys
from typing import Callable, Iterable, NamedTuple

import jax

__all__ = [
  "CompatError",
  "Probe",
  "CHECKS",
  "probes",
  "check",
  "trace_eqns",
  "only_eqn",
  "in_shard_map",
]


class CompatError(RuntimeError):
  """The installed JAX or Flax changed something jact reads through `jact._compat`."""


class Probe(NamedTuple):
  """How one accessor is checked: its module, what it reads, the probe to run."""

  module: str
  reads: str
  run: Callable[[], None]


CHECKS: dict[str, Probe] = {}  # accessor name -> its probe, filled as the modules are imported


def probes(**reads: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
  """Registers the decorated function as the probe of each accessor named in
  `reads` (accessor name -> what of JAX or Flax it reads), in the caller's module."""

  def register(run: Callable[[], None]) -> Callable[[], None]:
    for name, what in reads.items():
      known = CHECKS.get(name)
      if known is not None and known.module != run.__module__:
        raise ValueError(
          f"accessor name {name!r} is probed in both {known.module} and "
          f"{run.__module__}; accessor names must be unique in jact._compat"
        )
      CHECKS[name] = Probe(run.__module__, what, run)
    return run

  return register


def _versions() -> str:
  found = [f"jax {jax.__version__}"]
  flax = sys.modules.get("flax")
  if flax is not None:
    found.append(f"flax {flax.__version__}")
  return ", ".join(found)


def check(names: Iterable[str] | None = None) -> None:
  """Runs the probe of each accessor in `names` (default: every accessor of
  the `jact._compat` modules imported so far) on a tiny program; raises a
  CompatError naming each broken access, what it reads and its module."""
  names = list(CHECKS) if names is None else list(names)
  unknown = [n for n in names if n not in CHECKS]
  if unknown:
    raise ValueError(f"no compat check named {unknown}; choose from {sorted(CHECKS)}")
  broken = []
  for name in names:
    module, what, run = CHECKS[name]
    try:
      run()
    except Exception as e:  # any failure of a probe is a changed access  # noqa: BLE001
      broken.append(f"{module}.{name} ({what}): {type(e).__name__}: {e}")
  if broken:
    raise CompatError(
      f"{_versions()} changed what jact reads through jact._compat; update these "
      "accessors (each names the public API that would replace it):\n  " + "\n  ".join(broken)
    )


# ----------------------------------------------------------------------------- probe helpers


def trace_eqns(fn: Callable, *args) -> list:
  """The equations of `jax.make_jaxpr(fn)(*args)`."""
  return list(jax.make_jaxpr(fn)(*args).jaxpr.eqns)


def only_eqn(eqns, primitive):
  """The one equation of `eqns` that binds `primitive`."""
  found = [e for e in eqns if e.primitive is primitive]
  assert len(found) == 1, (
    f"expected one {primitive} equation, got {[str(e.primitive) for e in eqns]}"
  )
  return found[0]


def in_shard_map(fn: Callable, *args):
  """Runs `fn` inside a shard_map over a one-device mesh axis 'i' (args replicated)."""
  mesh = jax.make_mesh(
    (1,), ("i",), devices=jax.devices()[:1], axis_types=(jax.sharding.AxisType.Auto,)
  )
  return jax.shard_map(
    fn, mesh=mesh, in_specs=jax.sharding.PartitionSpec(), out_specs=jax.sharding.PartitionSpec()
  )(*args)
