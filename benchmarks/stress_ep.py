"""Do expert-parallel jobs on gloo exit cleanly? The EP=2 and EP=4 equality check, N times in
a row, each run a fresh set of processes with the plain shutdown (import torch_moe,
init_process_group, work, destroy_process_group(), interpreter exit); counts the runs in
which a rank aborted (non-zero exit status, -6 = SIGABRT), hung (killed after
``--timeout``) or computed a wrong result.

    python benchmarks/stress_ep.py --runs 50            # EP=2 and EP=4, 50 runs each
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

WORKER = r"""
import copy, sys
import torch
import torch_moe  # first, as a user would (it imports what the first op call would)
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module
from torch_moe.distributed import ExpertParallel
from torch_moe.nn import MoE

rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
mesh = init_device_mesh("cpu", (world,))
torch.manual_seed(0)
moe = MoE(16, 32, 8, 2, shared_hidden_dim=8)
ref = copy.deepcopy(moe)
parallelize_module(moe, mesh, ExpertParallel(num_chunks=2))
tokens = [7, 12, 0, 5][:world]
gen = torch.Generator().manual_seed(1)
x_all = torch.randn(sum(tokens), 16, generator=gen)
start = sum(tokens[:rank])
x = x_all[start : start + tokens[rank]].clone().requires_grad_()
out = moe(x)
out.sum().backward()
x_ref = x_all.clone().requires_grad_()
out_ref = ref(x_ref)
out_ref.sum().backward()
ok = torch.allclose(out, out_ref[start : start + tokens[rank]], rtol=1e-5, atol=1e-6)
ok = ok and torch.allclose(x.grad, x_ref.grad[start : start + tokens[rank]], rtol=1e-5, atol=1e-6)
dist.destroy_process_group()
sys.exit(0 if ok else 3)
"""


def run_once(world: int, timeout: float) -> tuple[list[int | None], str]:
    """Exit codes (None: killed after ``timeout``) and, when a rank failed, the tail of its
    stderr. stderr goes to files: a pipe nobody reads fills at 64 KiB and blocks the rank
    (a hang of the harness, not of the job)."""
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        logs = [open(os.path.join(tmp, f"rank{rank}.err"), "w+b") for rank in range(world)]
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", WORKER, str(rank), str(world), store],
                stdout=subprocess.DEVNULL,
                stderr=logs[rank],
                env=env,
            )
            for rank in range(world)
        ]
        codes: list[int | None] = []
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
                codes.append(p.returncode)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                codes.append(None)
        tail = ""
        for rank, (code, log) in enumerate(zip(codes, logs)):
            if code != 0:
                log.seek(0)
                text = log.read().decode(errors="replace").strip().splitlines()[-5:]
                tail += f"  rank {rank} stderr: " + " | ".join(text) + "\n"
            log.close()
        return codes, tail


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--timeout", type=float, default=180)
    args = p.parse_args()
    print(f"# torch_moe EP exit stress: {args.runs} runs per EP degree, {' '.join(sys.argv[1:])}")
    rows = []
    for world in (int(w) for w in args.worlds.split(",")):
        aborts = hangs = wrong = 0
        t0 = time.monotonic()
        for i in range(args.runs):
            codes, tail = run_once(world, args.timeout)
            aborts += any(c not in (0, 3, None) for c in codes)
            hangs += any(c is None for c in codes)
            wrong += any(c == 3 for c in codes)
            if any(c != 0 for c in codes):
                print(f"EP={world} run {i}: exit codes {codes}\n{tail}", end="", flush=True)
        rows.append((world, aborts, hangs, wrong, time.monotonic() - t0))
    print("\n| EP | runs | aborts | hangs | wrong results | seconds |")
    print("|---|---|---|---|---|---|")
    for world, aborts, hangs, wrong, secs in rows:
        print(f"| {world} | {args.runs} | {aborts} | {hangs} | {wrong} | {secs:.0f} |")


if __name__ == "__main__":
    main()
