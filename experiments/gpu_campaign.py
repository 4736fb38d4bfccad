"""Every owed GPU measurement in one device call of at most 8 minutes, most valuable first.

A chunk is one command (`python -m experiments.<script> ... --json FILE`) run
with a timeout in its own process group, so a chunk that hangs, runs out of
memory or crashes is killed or recorded and the next one still runs. Each
chunk leaves `DIR/<chunk>.json` (command, exit code, seconds, device, versions,
date, the tail of its output and the script's own JSON under "result") as soon
as it ends, and `DIR/summary.json` is rewritten after every chunk (entries of
chunks run earlier into the same DIR are kept), so a call cut short keeps what
finished. The stages, in order:

  i    versions, `_compat` probes, every kernel bit-exact vs its XLA reference
  ii   every kernel's GB/s vs a same-run device-to-device copy
  iii  ResNet-50 224x224 and a transformer LM: step time, compile time,
       compiled and peak memory, plain vs jact 8/4/2 bits (LM: and jact.checkpoint)
  iv   largest ResNet-50 batch that fits, plain vs jact 2 bits
  v    fidelity: pre-act ResNet-20 on full CIFAR-10, FP / 2 bits / ActNN L3 /
       BLPA 2 bits, two seeds, 10 epochs or what the time left allows

On a GPU each chunk's timeout is its `budget_s` (the fidelity chunks: the time
left), cut to `--deadline-s` (default 470 s); a chunk that would start with
under a minute left is recorded as skipped (rerun it by name: `--chunks
fidelity_seed1`). The GPU call (the machine has jax preinstalled; jact goes on
the path without installing anything; the CIFAR-10 file travels in the tree):

    JACT_DATA=gpu_data PYTHONPATH=. python -m experiments.gpu_campaign --out DIR

Without a GPU (`jax.default_backend() != "gpu"`), or with `--smoke`, every
chunk runs at tiny sizes instead: a smoke run that checks the commands,
scripts and JSON end to end (Pallas kernels in interpret mode). It says so in
its output and in the summary ("smoke run on cpu: no GPU figure"); none of its
numbers is a GPU figure. Its chunks share one temporary compilation cache; a
GPU run uses none (compile times are reported).

    python -m experiments.gpu_campaign --smoke --out /tmp/smoke
    python -m experiments.gpu_campaign --list
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from experiments.gpu.chunks import CHUNKS, STAGES, Chunk, command, select
from experiments.gpu.extras import ensure_extras
from experiments.lib.resumable import write_json

__all__ = ["CHUNKS", "STAGES", "Chunk", "select", "command", "probe", "run_chunk", "main"]

ROOT = Path(__file__).resolve().parents[1]
SMOKE_NOTE = "smoke run on {backend}: no GPU figure"
TAIL_CHARS = 20000
MIN_START_S = 60  # a chunk is not started with less time than this left before --deadline-s
GPU_DEADLINE_S = 470.0  # one device call: 8 minutes, the jax import and device probe included
SMOKE_TIMEOUT_S = 300.0  # per chunk in a smoke run


def _shown(cmd: list[str]) -> str:
  return shlex.join(["python", *cmd[1:]])


_PROBE = (
  "import json, sys; from experiments.lib.metadata import run_metadata; "
  "print('JACT_PROBE ' + json.dumps(run_metadata('experiments.gpu_campaign', sys.argv[1:])))"
)


def probe(argv: list[str], timeout: float = 300) -> dict:
  """Device, backend and versions, read in a subprocess (so this process never
  holds GPU memory while the chunks run)."""
  try:
    run = subprocess.run(
      [sys.executable, "-c", _PROBE, *argv],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=timeout,
      check=False,
    )
  except subprocess.TimeoutExpired:
    return {"backend": "unknown", "error": f"device probe timed out after {timeout} s"}
  for line in run.stdout.splitlines():
    if line.startswith("JACT_PROBE "):
      return json.loads(line[len("JACT_PROBE ") :])
  return {"backend": "unknown", "error": (run.stdout + run.stderr)[-2000:]}


def _pump(stream, name: str, tail: list[str]) -> None:
  """Echoes a chunk's output line by line (prefixed) and keeps its tail."""
  size = 0
  for line in stream:
    sys.stdout.write(f"[{name}] {line}")
    sys.stdout.flush()
    tail.append(line)
    size += len(line)
    while size > TAIL_CHARS and len(tail) > 1:
      size -= len(tail.pop(0))


def _children_cpu_s() -> float:
  """User + system CPU seconds of this process's finished children."""
  usage = resource.getrusage(resource.RUSAGE_CHILDREN)
  return usage.ru_utime + usage.ru_stime


def run_chunk(
  chunk: Chunk, smoke: bool, timeout: float, env: dict | None = None, out: str | os.PathLike = "DIR"
) -> dict:
  """Runs one chunk (with `env` added to the environment); its record (exit
  code, seconds, timed out, output tail, its JSON)."""
  with tempfile.TemporaryDirectory(prefix="jact_campaign_") as tmp:
    json_path = Path(tmp) / f"{chunk.name}.json"
    cmd = command(chunk, smoke, json_path, out, timeout)
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    t0, cpu0 = time.perf_counter(), _children_cpu_s()
    # Its own process group (same session: whoever ends this run's session ends it too).
    proc = subprocess.Popen(
      cmd,
      cwd=ROOT,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      errors="replace",
      process_group=0,
    )
    tail: list[str] = []
    reader = threading.Thread(target=_pump, args=(proc.stdout, chunk.name, tail), daemon=True)
    reader.start()
    timed_out = False
    try:
      code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      timed_out = True
      code = None
    finally:  # timed out, or this run interrupted: end the chunk's process group, nothing else
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait() if code is None else code
    reader.join(timeout=30)
    seconds, cpu = time.perf_counter() - t0, _children_cpu_s() - cpu0
    result = json.loads(json_path.read_text()) if json_path.exists() else None
  return {
    "command": _shown(cmd),
    "started": started,
    "exit_code": code,
    "seconds": round(seconds, 1),
    "cpu_s": round(cpu, 1),
    "timed_out": timed_out,
    "timeout_s": round(timeout, 1),
    "output_tail": "".join(tail),
    "result": result,
  }


def _entry(chunk: Chunk, record: dict, meta: dict, smoke: bool) -> dict:
  """The chunk's line in the summary."""
  on_gpu = meta.get("backend") == "gpu"
  return {
    "chunk": chunk.name,
    "stage": chunk.stage,
    "measures": chunk.measures,
    "command": record["command"],
    "exit_code": record["exit_code"],
    "seconds": record["seconds"],
    "cpu_s": record.get("cpu_s"),
    "timed_out": record["timed_out"],
    "skipped": record.get("skipped", False),
    "json": f"{chunk.name}.json",
    "date": record["started"],
    "device": meta.get("device"),
    "backend": meta.get("backend"),
    "jax": meta.get("jax"),
    "jaxlib": meta.get("jaxlib"),
    "on_gpu": on_gpu,
    "smoke": smoke,
    "gpu_figure": on_gpu and not smoke,
    "budget_s": chunk.budget_s,
  }


def _note(meta: dict, smoke: bool) -> str:
  backend = meta.get("backend", "unknown")
  if smoke:
    return SMOKE_NOTE.format(backend=backend)
  return f"GPU run on {meta.get('device')}"


def _write_summary(out: Path, meta: dict, smoke: bool, entries: dict, argv: list[str]) -> dict:
  """summary.json: this run's device and note, and every chunk's entry (earlier runs' kept)."""
  path = out / "summary.json"
  previous = {}
  if path.exists():
    try:
      previous = json.loads(path.read_text()).get("chunks", {})
    except (json.JSONDecodeError, AttributeError):
      previous = {}
  chunks = {**previous, **entries}
  summary = {
    "campaign": "experiments.gpu_campaign",
    "command": _shown([sys.executable, "-m", "experiments.gpu_campaign", *argv]),
    "smoke": smoke,
    "on_gpu": meta.get("backend") == "gpu",
    "note": _note(meta, smoke),
    "device": meta.get("device"),
    "backend": meta.get("backend"),
    "jax": meta.get("jax"),
    "jaxlib": meta.get("jaxlib"),
    "date": meta.get("date"),
    "probe": meta,
    "all_exit_zero": all(e["exit_code"] == 0 for e in chunks.values()),
    "chunks": {c.name: chunks[c.name] for c in CHUNKS if c.name in chunks},
  }
  write_json(path, summary)
  return summary


def _interrupted(signum, frame):
  del frame
  raise KeyboardInterrupt(f"signal {signum}")


def _banner(text: str) -> None:
  line = "=" * max(60, len(text) + 8)
  print(f"\n{line}\n=== {text.upper()} ===\n{line}\n", flush=True)


def list_chunks(smoke: bool) -> str:
  lines = []
  for stage in STAGES:
    lines.append(f"stage {stage}:")
    for c in (c for c in CHUNKS if c.stage == stage):
      budget = "the time left" if c.budget_s is None else f"{c.budget_s:g} s"
      lines.append(f"  {c.name:18s} {budget:>13s}  {c.measures}")
      lines.append(f"    gpu:   {_shown(command(c, False, f'DIR/{c.name}.json'))}")
      if smoke:
        lines.append(f"    smoke: {_shown(command(c, True, f'DIR/{c.name}.json'))}")
  return "\n".join(lines)


def _smoke_env(cache_dir: str) -> dict:
  """A smoke run's chunks share one compilation cache (deleted afterwards): the
  tiny ResNet's init and steps are compiled once, not once a chunk. Never on a
  GPU run, whose compile times are reported."""
  if "JAX_COMPILATION_CACHE_DIR" in os.environ:
    return {}
  return {
    "JAX_COMPILATION_CACHE_DIR": cache_dir,
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
  }


def _skipped(chunk: Chunk, smoke: bool, left: float, deadline: float) -> dict:
  return {
    "command": _shown(command(chunk, smoke, f"{chunk.name}.json")),
    "exit_code": None,
    "seconds": 0.0,
    "timed_out": False,
    "skipped": True,
    "output_tail": "",
    "result": None,
    "started": None,
    "reason": f"deadline: {max(left, 0):.0f} s left of --deadline-s {deadline:g}",
  }


def chunk_timeout(chunk: Chunk, smoke: bool, left: float | None, timeout_s: float | None) -> float:
  """A chunk's timeout: `--timeout-s` if given, else its GPU budget (the time
  left for the fidelity chunks) or, in a smoke run, SMOKE_TIMEOUT_S; never past
  the deadline."""
  if timeout_s is None:
    timeout_s = SMOKE_TIMEOUT_S if smoke else chunk.budget_s
  limits = [t for t in (timeout_s, left) if t is not None]
  return min(limits) if limits else SMOKE_TIMEOUT_S


def _run_all(
  chunks: list[Chunk],
  args,
  argv: list[str],
  meta: dict,
  smoke: bool,
  out: Path,
  t_start: float,
  env: dict,
  deadline: float | None,
) -> tuple[dict, dict]:
  """Runs the chunks in order, writing each one's JSON and the summary after each."""
  entries, summary = {}, {}
  for chunk in chunks:
    left = None if deadline is None else deadline - (time.perf_counter() - t_start)
    if left is not None and left < MIN_START_S:
      record = _skipped(chunk, smoke, left, deadline)
      print(f"--- {chunk.name}: skipped ({record['reason']})", flush=True)
    else:
      timeout = chunk_timeout(chunk, smoke, left, args.timeout_s)
      print(
        f"--- {chunk.name} (stage {chunk.stage}, timeout {timeout:.0f} s): "
        f"{_shown(command(chunk, smoke, f'{chunk.name}.json', out, timeout))}",
        flush=True,
      )
      record = run_chunk(chunk, smoke, timeout, env, out)
      status = "timed out" if record["timed_out"] else f"exit {record['exit_code']}"
      print(f"--- {chunk.name}: {status} after {record['seconds']:.1f} s", flush=True)
    entries[chunk.name] = _entry(chunk, record, meta, smoke)
    write_json(
      out / f"{chunk.name}.json",
      {**entries[chunk.name], **record, "note": _note(meta, smoke), "probe": meta},
    )
    summary = _write_summary(out, meta, smoke, entries, argv)
  return entries, summary


def _report(entries: dict, summary: dict, smoke: bool, out: Path, total: float) -> int:
  """Prints the table of chunks; 1 if any chunk did not exit 0, else 0."""
  print(f"\n{'chunk':20s} {'exit':>5s} {'seconds':>8s} {'CPU s':>7s}")
  for name, e in entries.items():
    state = "skip" if e["skipped"] else "T/O" if e["timed_out"] else str(e["exit_code"])
    print(f"{name:20s} {state:>5s} {e['seconds']:8.1f} {e['cpu_s'] or 0:7.1f}")
  cpu = sum(e["cpu_s"] or 0 for e in entries.values())
  print(f"total {total:.1f} s wall, {cpu:.1f} s CPU in the chunks; summary: {out / 'summary.json'}")
  if smoke:
    _banner(summary["note"])
  return 1 if any(e["exit_code"] != 0 for e in entries.values()) else 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", help="folder for <chunk>.json and summary.json")
  parser.add_argument(
    "--chunks",
    nargs="+",
    default=None,
    help=f"chunk or stage names ({', '.join(STAGES)}) or all (default)",
  )
  parser.add_argument("--list", action="store_true", help="print the chunks and their commands")
  parser.add_argument("--smoke", action="store_true", help="tiny sizes even on a GPU")
  parser.add_argument(
    "--timeout-s",
    type=float,
    default=None,
    help=f"per chunk (default: its GPU budget; smoke run: {SMOKE_TIMEOUT_S:g})",
  )
  parser.add_argument(
    "--deadline-s",
    type=float,
    default=None,
    help="wall-clock limit of this whole invocation (default on a GPU: "
    f"{GPU_DEADLINE_S:g}; chunks' timeouts are cut to it; chunks that "
    "would start with under a minute left are skipped)",
  )
  args = parser.parse_args(argv)
  argv = list(sys.argv[1:] if argv is None else argv)
  if args.list:
    print(list_chunks(smoke=True))
    return 0
  if not args.out:
    parser.error("--out is required (or --list)")
  try:
    chunks = select(args.chunks)
  except ValueError as e:
    parser.error(str(e))
  previous_handler = signal.signal(signal.SIGTERM, _interrupted)  # a killed run ends its chunk
  try:
    return _campaign(chunks, args, argv)
  finally:
    signal.signal(signal.SIGTERM, previous_handler)


def _campaign(chunks: list[Chunk], args, argv: list[str]) -> int:
  t_start = time.perf_counter()
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  extras = ensure_extras()  # before the chunks' processes import jact
  meta = probe(argv)
  meta["extras"] = extras
  smoke = args.smoke or meta.get("backend") != "gpu"
  if smoke:
    _banner(
      SMOKE_NOTE.format(backend=meta.get("backend", "unknown"))
      + " -- tiny sizes, every number below is meaningless"
    )
  else:
    _banner(f"GPU campaign on {meta.get('device')} (jax {meta.get('jax')})")
  deadline = args.deadline_s if args.deadline_s is not None or smoke else GPU_DEADLINE_S
  with tempfile.TemporaryDirectory(prefix="jact_campaign_cache_") as cache:
    entries, summary = _run_all(
      chunks, args, argv, meta, smoke, out, t_start, _smoke_env(cache) if smoke else {}, deadline
    )
  return _report(entries, summary, smoke, out, time.perf_counter() - t_start)


if __name__ == "__main__":
  sys.exit(main())
