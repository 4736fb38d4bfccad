"""Which buffers are alive at the temp-memory peak of a compiled XLA module.

Dump a compilation with `XLA_FLAGS=--xla_dump_to=DIR`, then

    python experiments/bench/xla_live_buffers.py DIR [MODULE_SUBSTRING] [--top N]

reads DIR's `*live-range.txt` and `*buffer-assignment.txt` for the module
(default: the largest one), sums the sizes of the values alive at each point
of XLA's schedule (parameters and live-out values excluded) and prints the
biggest values alive at the peak with their live ranges. A value whose range
spans from the forward pass into the backward pass is what keeps memory up.
"""

from __future__ import annotations

import argparse
import glob
import os
import re

import numpy as np


def _files(dump_dir: str, module: str | None) -> tuple[str, str]:
  ranges = glob.glob(os.path.join(dump_dir, f"module_*{module or ''}*live-range.txt"))
  if not ranges:
    raise SystemExit(f"no *live-range.txt for {module!r} in {dump_dir}")
  live = max(ranges, key=os.path.getsize)
  return live, live.replace("live-range.txt", "buffer-assignment.txt")


def live_at_peak(dump_dir: str, module: str | None = None):
  """Returns (peak instruction, peak bytes, [(bytes, value, shape, start, end)])."""
  live_file, assignment_file = _files(dump_dir, module)
  sequence, ranges = {}, []
  for line in open(live_file).read().splitlines():
    m = re.match(r"\s+(\d+):(\S+)$", line)
    if m:
      sequence[int(m.group(1))] = m.group(2)
      continue
    m = re.match(r"\s+(\S+?)(\{[\d,]*\})?:(\d+)-(\d+)$", line)
    if m:
      ranges.append((m.group(1) + (m.group(2) or "{}"), int(m.group(3)), int(m.group(4))))
  sizes, shapes = {}, {}
  pattern = r"value: <\d+ (\S+?)(\{[\d,]*\})? @\d+> \(size=(\d+),offset=\d+\): (\S+)"
  for m in re.finditer(pattern, open(assignment_file).read()):
    key = m.group(1) + (m.group(2) or "{}")
    sizes[key], shapes[key] = int(m.group(3)), m.group(4)
  end_time = max(e for _, _, e in ranges) + 1
  inner = [(n, s, e) for n, s, e in ranges if not (s == 0 and e >= end_time - 1)]
  usage = np.zeros(end_time)
  for name, start, end in inner:
    usage[start : end + 1] += sizes.get(name, 0)
  peak = int(usage.argmax())
  alive = sorted(
    ((sizes.get(n, 0), n, shapes.get(n, ""), s, e) for n, s, e in inner if s <= peak <= e),
    reverse=True,
  )
  return sequence.get(peak), float(usage[peak]), alive


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("dump_dir")
  parser.add_argument("module", nargs="?", default=None)
  parser.add_argument("--top", type=int, default=30)
  args = parser.parse_args(argv)
  instruction, total, alive = live_at_peak(args.dump_dir, args.module)
  print(f"peak at {instruction}: {total / 2**20:.1f} MiB alive (values, before buffer reuse)")
  for size, name, shape, start, end in alive[: args.top]:
    print(f"{size / 2**20:8.2f} MiB  {name:45s} {shape:30s} {start}-{end}")


if __name__ == "__main__":
  main()
