"""``torchrun`` target of ``test_expert_parallel.TestTrainExampleEP``: runs
``examples/train_moe_lm.py``'s ``main`` once per argument list (lists separated by
``--then``) inside one process group, so one launch (one launcher and one start-up of each
rank, each importing torch) covers several runs of the example."""

import gc
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import train_moe_lm


def split_runs(argv: list[str]) -> list[list[str]]:
    runs: list[list[str]] = [[]]
    for arg in argv:
        if arg == "--then":
            runs.append([])
        else:
            runs[-1].append(arg)
    return runs


if __name__ == "__main__":
    dist.init_process_group("gloo")
    for run in split_runs(sys.argv[1:]):
        train_moe_lm.main(run)  # main leaves a group it did not create alone
    dist.destroy_process_group()
    gc.collect()  # as the example does: gloo's threads joined before interpreter exit
