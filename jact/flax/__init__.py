"""internal: being removed (only _compat.py is left, moving to jact._compat.flax)."""
