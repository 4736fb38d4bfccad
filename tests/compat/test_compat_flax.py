"""jact._compat.flax, the one home of jact's private / internal Flax accesses.

`check()` exercises each access on tiny models and names the broken ones (its
probe gate, shared with the JAX accessors, is tested in tests/compat/test_compat.py); the
gate keeps every other jact module off Flax internals (file:line on failure);
the attention twins take every keyword of the installed Flax's
dot_product_attention, read from its signature, so a keyword a new Flax adds is
covered without editing these tests.
"""

import ast
import inspect
import io
import pathlib
import re
import tokenize

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jact._compat import flax as _compat
from jact._compat.flax import linen as compat_linen
from jact._compat.flax import nnx as compat_nnx
from jact._flax import hooks as _hooks
from jact import nn as jnn
from jact import nnx as jnnx

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMPAT = ROOT / "jact" / "_compat" / "flax"
FLAX_PROBES = [n for n, p in _compat.CHECKS.items() if p.module.startswith("jact._compat.flax.")]


# ----------------------------------------------------------------------------- check()


@pytest.mark.slow
@pytest.mark.parametrize("name", FLAX_PROBES)
def test_flax_access_still_works(name):
  _compat.check([name])


def test_every_flax_accessor_is_probed():
  assert set(FLAX_PROBES) == set(_compat.__all__) - {"CompatError", "CHECKS", "check"}


@pytest.mark.slow
def test_check_names_each_broken_access(monkeypatch):
  monkeypatch.setattr(compat_nnx, "peek_stream_key", lambda stream: jax.random.key(12345))
  monkeypatch.setattr(compat_linen, "_capture_stack", lambda: None)
  with pytest.raises(_compat.CompatError) as err:
    _compat.check(FLAX_PROBES)
  message = str(err.value)
  assert (
    "jact._compat.flax.nnx.peek_stream_key (" in message
    and "jact._compat.flax.linen.suppress_capture (" in message
  ), message
  assert "nnx_twin_of (" not in message and "lift_method_call (" not in message, message
  assert flax.__version__ in message


# ----------------------------------------------------------------------------- the gate

# Private or internal Flax idioms, looked for in code (comments and docstrings removed).
PATTERNS = {
  "linen's private method dispatcher": r"\b_call_wrapped_method\b",
  "linen's capture_intermediates stack": r"\bcapture_stack\b",
  "nnx's private Pytree bookkeeping": r"_pytree__",
  "object.__setattr__ past a class's own __setattr__": r"\bobject\.__setattr__\((?!\s*self\s*,)",
  "flax.nnx.module.first_from (not exported)": r"\bfirst_from\b",
  "flax.linen.transforms internals": r"\blinen\.transforms\b|\b(get|set)_module_scopes\b",
  "flax.core.lift.pack": r"\blift\.pack\b",
  "flax.nnx.rnglib (use nnx.Rngs / nnx.RngStream)": r"\brnglib\b",
  "a linen Module's private _state": r"\._state\b",
  "flax.core Scope.rewound": r"\.rewound\(",
  "an RngStream's key derivation": r"\.(key|count)\[\.\.\.\]",
  "construction without __init__": r"\.__new__\(",
}
# flax (sub)packages jact may name; any other flax module is internal.
PUBLIC_MODULES = {
  "flax",
  "flax.linen",
  "flax.nnx",
  "flax.struct",
  "flax.serialization",
  "flax.traverse_util",
  "flax.training",
}
PUBLIC_ATTRIBUTE_MODULES = {"initializers"}  # nn.initializers, nnx.initializers


def _code_lines(source: str) -> list[str]:
  """`source`'s lines with comments and docstrings blanked."""
  lines = source.splitlines()
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT:
      row, col = tok.start
      lines[row - 1] = lines[row - 1][:col]
  for node in ast.walk(ast.parse(source)):
    body = getattr(node, "body", None)
    if (
      isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
      and body
      and isinstance(body[0], ast.Expr)
      and isinstance(body[0].value, ast.Constant)
      and isinstance(body[0].value.value, str)
    ):
      for row in range(body[0].lineno, body[0].end_lineno + 1):
        lines[row - 1] = ""
  return lines


def _flax_module(name: str):
  obj = flax
  for part in name.split(".")[1:]:
    obj = getattr(obj, part, None)
  return obj


def _ast_findings(tree: ast.AST) -> list[tuple[int, str]]:
  """Imports of internal flax modules, and private or submodule attributes reached
  through a name bound to flax."""
  found, aliases = [], {}
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.name == "flax" or a.name.startswith("flax."):
          if a.name not in PUBLIC_MODULES:
            found.append((node.lineno, f"import of internal module {a.name}"))
          aliases[a.asname or a.name.split(".")[0]] = _flax_module(a.name if a.asname else "flax")
    elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "flax":
      if node.module not in PUBLIC_MODULES:
        found.append((node.lineno, f"import from internal module {node.module}"))
        continue
      parent = _flax_module(node.module)
      for a in node.names:
        value = getattr(parent, a.name, None)
        full = f"{node.module}.{a.name}"
        if a.name.startswith("_"):
          found.append((node.lineno, f"import of private {full}"))
        elif inspect.ismodule(value) and value.__name__ not in PUBLIC_MODULES:
          found.append((node.lineno, f"import of internal module {full}"))
        aliases[a.asname or a.name] = value
  for node in ast.walk(tree):
    if not isinstance(node, ast.Attribute) or isinstance(
      getattr(node, "_parent", None), ast.Attribute
    ):
      continue
    chain, root = [], node
    while isinstance(root, ast.Attribute):
      chain.append(root.attr)
      root = root.value
    if not isinstance(root, ast.Name) or root.id not in aliases:
      continue
    obj, path = aliases[root.id], root.id
    for attr in reversed(chain):
      path += "." + attr
      if attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__")):
        found.append((node.lineno, f"private attribute {path}"))
        break
      obj = getattr(obj, attr, None)
      if (
        inspect.ismodule(obj)
        and obj.__name__ not in PUBLIC_MODULES
        and attr not in PUBLIC_ATTRIBUTE_MODULES
      ):
        found.append((node.lineno, f"internal module {path}"))
        break
  return found


def _scan(source: str, name: str) -> list[str]:
  """ "name:line: what" for every private or internal Flax access in `source`."""
  lines = list(_code_lines(source))
  # a call the formatter split after its "(" is read with its first argument's line
  joined = [
    line + (" " + lines[row].strip() if line.rstrip().endswith("(") and row < len(lines) else "")
    for row, line in enumerate(lines, 1)
  ]
  hits = [
    f"{name}:{row}: {what}: {line.strip()}"
    for row, line in enumerate(joined, 1)
    for what, pattern in PATTERNS.items()
    if re.search(pattern, line)
  ]
  tree = ast.parse(source)
  for parent in ast.walk(tree):
    for child in ast.iter_child_nodes(parent):
      child._parent = parent
  hits += [f"{name}:{row}: {what}" for row, what in _ast_findings(tree)]
  return hits


GATE_SAMPLE = '''"""Docstring naming _call_wrapped_method and lift.pack is prose."""
import flax.linen as nn
from flax import nnx
from flax.core import lift
from flax.nnx import rnglib
from flax.linen import transforms
from flax.nnx.module import first_from
# a comment naming capture_stack is prose too
m._call_wrapped_method(f, a, k)
s = nn.module._context.capture_stack
object.__setattr__(twin, "_pytree__state", None)
object.__setattr__(self, "ok", 1)
lift.pack(f, (True,), (True,), (True,))
linen_transforms.get_module_scopes(m, a, k)
m._state.export()
m.scope.rewound()
stream.count[...]
cls.__new__(cls)
nnx.graphlib.split
nn._private
y = nn.Dense(3, kernel_init=nnx.initializers.ones)(x)
object.__setattr__(
  self, "ok", 1)
object.__setattr__(
  twin, "x", 1)
'''
GATE_FLAGGED = {4, 5, 6, 7, 9, 10, 11, 13, 14, 15, 16, 17, 18, 19, 20, 24}


def test_gate_finds_each_idiom():
  """The gate itself: every idiom it looks for is found, prose and public code are not."""
  hits = _scan(GATE_SAMPLE, "sample.py")
  assert {int(h.split(":")[1]) for h in hits} == GATE_FLAGGED, "\n".join(hits)


def test_no_private_flax_access_outside_compat():
  hits = []
  for path in sorted((ROOT / "jact").rglob("*.py")):
    if COMPAT not in path.parents:
      hits += _scan(path.read_text(), str(path.relative_to(ROOT)))
  assert not hits, (
    "private/internal Flax access outside jact/_compat/flax/; wrap it "
    "there (a named function with its public replacement):\n" + "\n".join(hits)
  )


# ----------------------------------------------------------------------------- attention keywords

FLAX_ATTENTION = {"linen": nn.dot_product_attention, "nnx": nnx.dot_product_attention}
KEYWORDS = sorted(
  {name for fn in FLAX_ATTENTION.values() for name in list(inspect.signature(fn).parameters)[3:]}
)
DEFAULTS = [
  (name, p.default)
  for fn in FLAX_ATTENTION.values()
  for name, p in list(inspect.signature(fn).parameters.items())[3:]
]
ROUNDING = dict(bits=4, compressor=None)


def _qkv():
  keys = jax.random.split(jax.random.key(0), 3)
  return [jax.random.normal(k, (2, 5, 2, 8)) for k in keys]


def _twins():
  return {
    "jact.nn.MultiHeadDotProductAttention": jnn.MultiHeadDotProductAttention(num_heads=2),
    "jact.nnx.MultiHeadAttention": jnnx.MultiHeadAttention(
      2, 16, decode=False, rngs=nnx.Rngs(params=0, jact=1)
    ),
  }


def _slot_call(twin, fn_kwargs, ops=None):
  ops = ops or _hooks.attention_ops(jax.random.key(3), "att", ROUNDING)
  with _hooks.provide(**ops):
    return twin.attention_fn(*_qkv(), **fn_kwargs)


@pytest.mark.parametrize("twin_name", sorted(_twins()))
def test_attention_twin_declares_every_flax_keyword(twin_name):
  # linen's attention layer passes only the keywords its attention_fn declares
  declared = set(inspect.signature(_twins()[twin_name].attention_fn).parameters)
  for where, fn in FLAX_ATTENTION.items():
    missing = set(inspect.signature(fn).parameters) - declared
    assert not missing, f"{twin_name} does not declare {where} keywords {sorted(missing)}"


@pytest.mark.slow
@pytest.mark.parametrize("name,default", DEFAULTS, ids=[f"{n}" for n, _ in DEFAULTS])
def test_attention_twins_accept_every_flax_keyword(name, default):
  for twin_name, twin in _twins().items():
    want = _slot_call(twin, {})
    got = _slot_call(twin, {name: default})
    np.testing.assert_array_equal(got, want, err_msg=f"{twin_name}, {name}={default!r}")
  # the plain fallback (a linen twin during init without a 'jact' stream) too
  twin = _twins()["jact.nn.MultiHeadDotProductAttention"]
  plain = _slot_call(twin, {name: default}, ops={"attention": _hooks.plain_attention})
  np.testing.assert_array_equal(plain, nn.dot_product_attention(*_qkv()))


def test_attention_twins_reject_unsupported_flax_keywords_by_name():
  supported = set(_hooks.ATTENTION_HANDLED) | set(_hooks.ATTENTION_IGNORED)
  assert supported <= set(KEYWORDS), f"not Flax keywords: {sorted(supported - set(KEYWORDS))}"
  unsupported = [name for name in KEYWORDS if name not in supported]
  assert unsupported, "every keyword of Flax's attention is supported; this test has no case"
  marker = object()
  for twin in _twins().values():
    for name in unsupported:
      with pytest.raises(ValueError, match=rf"\b{re.escape(name)}\b"):
        _slot_call(twin, {name: marker})
  with pytest.raises(TypeError, match="not_a_flax_keyword"):
    _slot_call(twin, {"not_a_flax_keyword": 1})


def test_linen_attention_twin_rejects_custom_weights_einsums_by_name():
  # linen passes qk_attn_weights_einsum to an attention_fn that declares it;
  # before, the twin did not, so a custom einsum was silently dropped
  x = jnp.ones((1, 3, 8))
  layer = jnn.MultiHeadDotProductAttention(
    num_heads=2,
    qk_attn_weights_einsum_cls=lambda: jnp.einsum,
    attn_weights_value_einsum_cls=lambda: jnp.einsum,
  )
  variables = layer.init(jax.random.key(0), x)  # init without 'jact': Flax's own attention
  with pytest.raises(ValueError, match="qk_attn_weights_einsum"):
    layer.apply(variables, x, rngs={"jact": jax.random.key(1)})
