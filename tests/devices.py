"""XLA flags for the tests that run a program on 8 CPU devices in a subprocess.

XLA:CPU aborts a collective whose 8 device threads do not all arrive within
40 s. On a loaded 2-core machine one thread can be that late without anything
being wrong (seen with experiments running beside the suite), so the tests give
the rendezvous 10 minutes; a real deadlock still fails, at the subprocess's
own timeout.

>>> "--xla_force_host_platform_device_count=8" in EIGHT_CPU_DEVICES
True
"""

EIGHT_CPU_DEVICES = (
  "--xla_force_host_platform_device_count=8 --xla_cpu_collective_call_terminate_timeout_seconds=600"
)
