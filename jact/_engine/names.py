"""Residual names: the reserved `jact:` namespace of `checkpoint_name` tags.

Inside a compressed op every stored piece is tagged `jact:<name>`; outside
(where `jax.checkpoint` policies select by name) it carries the user's name.
`is_jact_name` recognises the reserved namespace; nothing is kept in a
process-global set.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name

from jact._engine import context as _context

__all__ = ["JACT_NAME_PREFIX", "is_jact_name", "tag", "check_name"]


def check_name(name: Any) -> str:
  if not isinstance(name, str) or not name:
    raise ValueError(
      f"a residual name must be a non-empty string, got {name!r}: pass "
      f"name='block1' (a string) as the residual-name prefix"
    )
  return name


JACT_NAME_PREFIX = "jact:"


def is_jact_name(name: Any) -> bool:
  """Whether a `checkpoint_name` is one jact's `tag` gave (its reserved namespace)."""
  return isinstance(name, str) and name.startswith(JACT_NAME_PREFIX)


def tag(tree, name: str):
  """Tags every array leaf of a residual with `name` (for checkpoint policies).

  Each leaf gets two `checkpoint_name`s: `JACT_NAME_PREFIX + name` inside,
  which jact's policies and an enclosing `compressed` select (a function of
  the name alone, whatever else the process traced), and `name` outside,
  which reports show and `jax.checkpoint_policies.save_only_these_names`
  selects. The name is also noted as traced for the enclosing plan blocks
  (which report plan entries naming no residual)."""
  _context.note_residual(name)
  return jax.tree.map(
    lambda a: checkpoint_name(checkpoint_name(a, JACT_NAME_PREFIX + name), name), tree
  )
