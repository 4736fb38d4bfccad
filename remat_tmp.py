import jax, jax.numpy as jnp, optax, time
import jact
from experiments.lib import fit_subjects, zoo
from jact._compiled_memory import compiled_memory
B,L,D,N = 16,128,128,8
params = fit_subjects.stack_params(jax.random.key(0), zoo.LM_CONFIG.vocab_size, N, D, 4*D)
tokens, labels = fit_subjects.shakespeare(B, L)
blk = fit_subjects.stack_block
def make(wrap):
  layers=[wrap(i) for i in range(N)]
  def loss(params, tokens, labels, key):
    x = params["embed"][tokens]
    for i,(layer, p) in enumerate(zip(layers, params["blocks"])):
      x = layer(p, x, key=jax.random.fold_in(key,i)) if getattr(layer,'keyed',False) else layer(p,x)
    logits = x @ params["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  return loss
def keyed(f): f.keyed=True; return f
variants = {
 "plain": lambda i: blk,
 "jax.checkpoint": lambda i: jax.checkpoint(blk),
 "jact.compressed4": lambda i: keyed(jact.compressed(blk, bits=4, name=f"b{i}")),
 "jact.checkpoint4": lambda i: keyed(jact.checkpoint(blk, bits=4, name=f"b{i}", compress_argnums=(1,))),
 "jact.checkpoint4_saveinputsonly": lambda i: keyed(jact.checkpoint(blk, bits=4, name=f"b{i}", compress_argnums=(1,), policy=jact.save_inputs_only() if hasattr(jact,'save_inputs_only') else None)),
}
for name, wrap in variants.items():
  loss = make(wrap)
  step = lambda p,t,l,k: jax.grad(loss)(p,t,l,k)
  t=time.perf_counter(); m = compiled_memory(step, params, tokens, labels, jax.random.key(0))
  print(f"{name:34s} temp {m.temp_bytes/2**20:8.2f} MiB  peak {(m.temp_bytes+m.argument_bytes+m.output_bytes)/2**20:8.2f}  compile {time.perf_counter()-t:.1f}s", flush=True)
