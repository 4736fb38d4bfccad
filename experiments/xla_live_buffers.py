"""Which buffers are live at the temp-memory peak of a dumped XLA:CPU module."""
import re, glob, sys
import numpy as np
d = sys.argv[1]; pat = sys.argv[2] if len(sys.argv) > 2 else 'jit_step'
f = glob.glob(f'{d}/module_*{pat}*live-range.txt')[0]
lines = open(f).read().split('\n')
seq, rng = {}, []
for l in lines:
    m = re.match(r'\s+(\d+):(\S+)$', l)
    if m: seq[int(m.group(1))] = m.group(2); continue
    m = re.match(r'\s+(\S+?)(\{[\d,]*\})?:(\d+)-(\d+)$', l)
    if m: rng.append((m.group(1) + (m.group(2) or '{}'), int(m.group(3)), int(m.group(4))))
ba = open(glob.glob(f'{d}/module_*{pat}*buffer-assignment.txt')[0]).read()
sizes, shapes, params = {}, {}, set()
for m in re.finditer(r'value: <\d+ (\S+?)(\{[\d,]*\})? @\d+> \(size=(\d+),offset=\d+\): (\S+)', ba):
    k = m.group(1) + (m.group(2) or '{}'); sizes[k] = int(m.group(3)); shapes[k] = m.group(4)
T = max(e for _, _, e in rng) + 1
use = np.zeros(T)
for n, s, e in rng:
    if s == 0 and e >= T - 1: continue  # params / live-out
    use[s:e+1] += sizes.get(n, 0)
t = int(use.argmax()); print('peak at', t, seq.get(t), '%.1f MiB' % (use[t]/2**20))
live = sorted([(sizes.get(n,0), n, s, e) for n, s, e in rng if s <= t <= e and not (s == 0 and e >= T-1)], reverse=True)
for sz, n, s, e in live[:int(sys.argv[3]) if len(sys.argv) > 3 else 30]:
    if sz < 2**19: break
    print(f"{sz/2**20:7.2f} MiB {n:45s} {shapes.get(n,''):28s} {s}-{e}")
