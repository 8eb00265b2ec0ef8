"""Torch-only reproducer: a gloo process group outlives destroy_process_group() when
torch._dynamo is first imported after init_process_group, and the interpreter can then
abort at exit ("terminate called without an active exception", SIGABRT).

    python repro_gloo_exit_abort.py --runs 16                # import after init (aborts)
    python repro_gloo_exit_abort.py --runs 16 --import-first # import before init (clean)

Each run starts two ranks as separate processes (gloo, a FileStore), each does
init_process_group, ``import torch._dynamo`` (before or after the init), three
all_reduces, destroy_process_group(), and a normal interpreter exit. The script counts
the runs where a rank's exit status is not 0 (-6 is SIGABRT).
"""

import argparse
import os
import subprocess
import sys
import tempfile

WORKER = r"""
import os, sys
import torch, torch.distributed as dist
first = sys.argv[3] == "1"
if first:
    import torch._dynamo  # noqa: F401
dist.init_process_group(
    "gloo", init_method="file://" + sys.argv[2], rank=int(sys.argv[1]), world_size=2
)
if not first:
    import torch._dynamo  # noqa: F401  (what the first torch.library custom-op call does)
t = torch.ones(1 << 16)
for _ in range(3):
    dist.all_reduce(t)
dist.destroy_process_group()
"""


def run_once(import_first: bool, timeout: float) -> list[int | None]:
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", WORKER, str(rank), store, "1" if import_first else "0"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            for rank in range(2)
        ]
        codes: list[int | None] = []
        for p in procs:
            try:
                p.wait(timeout=timeout)
                codes.append(p.returncode)
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(None)  # a hang
        return codes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--runs", type=int, default=16)
    p.add_argument("--import-first", action="store_true")
    p.add_argument("--timeout", type=float, default=120)
    args = p.parse_args()
    bad = 0
    for i in range(args.runs):
        codes = run_once(args.import_first, args.timeout)
        failed = any(c != 0 for c in codes)
        bad += failed
        print(f"run {i}: exit codes {codes}{'  <-- abort/hang' if failed else ''}", flush=True)
    mode = "before" if args.import_first else "after"
    print(f"torch._dynamo imported {mode} init_process_group: {bad} of {args.runs} runs failed")


if __name__ == "__main__":
    main()
