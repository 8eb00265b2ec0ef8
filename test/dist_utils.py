"""Shared pieces of the multi-process tests."""

import datetime
import tempfile
import unittest

import torch
from torch.testing._internal.common_distributed import MultiProcContinuousTest


class GlooContinuousTest(MultiProcContinuousTest):
    """One gloo process group of ``world_size`` CPU ranks for all the tests of a class
    (``self.rank``, ``self.world_size``), its workers always spawned.

    NB: always spawn. The base class sets the global start method to "spawn" only if nothing
    set it before; after another test class forked, the workers would be forked from a
    process whose OpenMP threads already ran, and hang in their first parallel op.
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
        ctx = torch.multiprocessing.get_context("spawn")
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
