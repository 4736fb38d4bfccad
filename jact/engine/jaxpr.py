"""Reading traced programs: checkpoint names of equations and the jaxprs
nested in call-like equations."""

from __future__ import annotations

__all__ = ["checkpoint_name_of"]


def checkpoint_name_of(eqn) -> str | None:
  """The `checkpoint_name` an equation applies, or None (any jax version)."""
  if eqn.primitive.name == "name" and isinstance(eqn.params.get("name"), str):
    return eqn.params["name"]
  prim = eqn.params.get("_prim")  # newer jax: checkpoint_name as a hi-primitive
  if type(prim).__name__ == "CheckpointName":
    return getattr(prim, "name", None)
  return None
