"""`moetron ...`, `python -m moetron ...` and `torchrun -m moetron ...`: the command line.

OpenMP threads that wait at a barrier sleep instead of spinning (`OMP_WAIT_POLICY=PASSIVE`, unless
set): a spinning thread holds its core, so when another process shares the machine the partner it
waits for cannot run, and every op stalls (the mid-size proxy on two threads of a 2-core machine
beside one busy process: 123-149 tokens/s spinning, 546-653 sleeping, 572-588 on one thread). On a
machine of its own spinning is ~15 % faster there (1139-1152 vs 963-976): `OMP_WAIT_POLICY=ACTIVE`.
The policy is read once, when torch loads its OpenMP runtime, so it is set before torch is imported.

The garbage collector is off while torch and moetron import (it walked their millions of objects
three times there, ~0.35 s of a 2-core machine), and what they imported is then frozen out of every
later collection, the one at exit included (~0.7 s: a process with torch loaded took 1.0 s to end).
Nothing imported is garbage; a run's own objects are collected as usual.
"""

import gc
import os
import sys


def main() -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    gc.disable()
    try:
        from moetron.cli import main as cli_main
    finally:
        gc.freeze()  # imported modules and functions live as long as the process
        gc.enable()
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
