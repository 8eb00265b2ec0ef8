"""Shared pieces of the multi-process tests."""

import datetime
import subprocess
import tempfile
import unittest
from collections.abc import Callable

import torch
from torch.testing._internal.common_distributed import MultiProcContinuousTest

# What every rank imports anyway: torch, torch_moe (which imports torch._dynamo) and the
# distributed test harness, about 3.5 s of CPU per process on a 2-core machine.
_PRELOAD = [
    "torch",
    "torch._functorch.aot_autograd",
    "torch.distributed.tensor",
    "torch.testing._internal.common_distributed",
    "torch_moe",
]


def worker_context():
    """The multiprocessing context the test ranks start in: a fork server that imported
    ``_PRELOAD`` once, so a rank starts in milliseconds instead of re-importing torch.

    NB: not "fork" from the test process: after a test there ran OpenMP-parallel ops, a
    forked child can hang in its first parallel op (the OpenMP runtime's thread pool does not
    survive fork). The fork server never runs a tensor op, so its children start clean. And
    not "spawn" (the base classes' default): it re-imports everything per rank. A rank sees
    the environment of the fork server, i.e. of the first test that started one: tests must
    not pass settings to their ranks through ``os.environ``.
    """
    ctx = torch.multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts (once)
    return ctx


class GlooContinuousTest(MultiProcContinuousTest):
    """One gloo process group of ``world_size`` CPU ranks for all the tests of a class
    (``self.rank``, ``self.world_size``), its workers started by ``worker_context()``.

    NB: the base class would set the global start method to "spawn" only if nothing set it
    before, and fork otherwise (see ``worker_context`` for why neither).
    """

    timeout = datetime.timedelta(seconds=120)

    def assertRaisesRegex(self, expected_exception, expected_regex, *args, **kwargs):
        # NB: MultiProcContinuousTest makes device_type a classmethod, so PyTorch's
        # TestCase.assertRaisesRegex sees a "non-native device" (a bound method is not in
        # NATIVE_DEVICES) and drops the regex: any message would pass. Check it.
        return unittest.TestCase.assertRaisesRegex(
            self, expected_exception, expected_regex, *args, **kwargs
        )

    @classmethod
    def backend_str(cls):
        return "gloo"

    @classmethod
    def device_type(cls):
        return "cpu"

    @classmethod
    def _spawn_processes(cls, world_size):
        ctx = worker_context()
        cls.processes, cls.task_queues, cls.completion_queues = [], [], []
        with tempfile.NamedTemporaryFile(delete=False) as f:
            cls.rdvz_file = f.name
        for rank in range(world_size):
            task_queue, completion_queue = ctx.Queue(), ctx.Queue()
            process = ctx.Process(
                target=cls._worker_loop,
                name=f"process {rank}",
                daemon=True,
                args=(rank, world_size, cls.rdvz_file, task_queue, completion_queue),
            )
            process.start()
            cls.processes.append(process)
            cls.task_queues.append(task_queue)
            cls.completion_queues.append(completion_queue)


# What a rank prints when it aborts at interpreter exit in gloo's shutdown race
# (upstream_patches/0002-distributed-gloo-exit): after its work and its output are done.
GLOO_EXIT_ABORT = "terminate called without an active exception"


def exit_aborted(proc: subprocess.CompletedProcess) -> bool:
    """Whether a launch failed only by gloo's abort at interpreter exit (SIGABRT)."""
    return proc.returncode != 0 and GLOO_EXIT_ABORT in proc.stderr


def start_launch(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    """A ``torchrun`` launch started in the background (``finish_launch`` waits for it)."""
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_launch(
    launch: subprocess.Popen,
    env: dict[str, str],
    timeout: float = 300,
    before_retry: Callable[[], None] | None = None,
) -> subprocess.CompletedProcess:
    """Wait for ``launch`` (killed past ``timeout``), and run it once more when it failed
    only by gloo's exit-time abort (``exit_aborted``; ``before_retry()`` first, e.g. to clear
    its output folder). The race is upstream's and timing-dependent (about 1 run in 20 under
    load); the examples avoid what they can of it (``gc.collect()`` after
    ``destroy_process_group()``). Any other failure, or the abort twice, is returned as is,
    so a launch that cannot exit cleanly still fails the test."""
    try:
        out, err = launch.communicate(timeout=timeout)
    finally:
        if launch.poll() is None:
            launch.kill()
    proc = subprocess.CompletedProcess(launch.args, launch.returncode, out, err)
    if exit_aborted(proc):
        if before_retry is not None:
            before_retry()
        proc = subprocess.run(launch.args, env=env, capture_output=True, text=True, timeout=timeout)
    return proc


def run_launch(
    cmd: list[str],
    env: dict[str, str],
    timeout: float = 300,
    before_retry: Callable[[], None] | None = None,
) -> subprocess.CompletedProcess:
    """``finish_launch(start_launch(cmd, env), ...)``: a ``torchrun`` launch, run once more
    when it failed only by gloo's exit-time abort."""
    return finish_launch(start_launch(cmd, env), env, timeout, before_retry)
