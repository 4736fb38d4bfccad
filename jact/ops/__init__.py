"""Compressed ops: exact forward, compressed residuals, exact VJP formulas."""

from jact.ops._core import Rounding
from jact.ops.linear import conv, conv_general_dilated, conv_transpose, dense, dot_general, einsum

__all__ = [
    "Rounding", "dot_general", "dense", "einsum", "conv_general_dilated", "conv", "conv_transpose",
]
