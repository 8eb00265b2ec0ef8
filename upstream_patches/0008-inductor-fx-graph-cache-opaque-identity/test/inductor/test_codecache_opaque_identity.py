# Owner(s): ["module: inductor"]
"""The FX graph cache key depends on object identity once an opaque DeviceMesh is in it
(torch 2.13.0).

FxGraphCachePickler pickles the key's details with ``pickler.fast = True`` so that pickle
does not memoize: with a memo, two equal but distinct objects (strings, devices) pickle to
other bytes than one object seen twice, and which equal objects share an identity differs
between processes. ``_reduce_fake_script_object`` sets ``self.fast = False`` for opaque
reference types such as DeviceMesh (their cycles need the memo) and never restores it, so
everything pickled after a DeviceMesh is memoized: the key of a graph whose inputs carry a
DeviceMesh (a compiled module with DTensor parameters) changes from process to process and
the FX graph cache never hits across processes.

test_key_ignores_identity_after_device_mesh is the behavior a fix must give: equal
details, equal keys, whatever object shares an identity with which.
"""

import unittest

import torch
import torch.distributed as dist
from torch._inductor.codecache import FxGraphCachePickler
from torch._library.fake_class_registry import maybe_to_fake_obj
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.common_utils import run_tests, TestCase


def _equal_distinct_strings():
    a, b = "".join(["tensor", "_meta"]), "".join(["tens", "or_meta"])
    assert a == b and a is not b
    return a, b


@unittest.skipIf(not dist.is_available(), "needs torch.distributed")
class TestFxGraphCacheKeyOpaqueIdentity(TestCase):
    def setUp(self):
        super().setUp()
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self.mesh = init_device_mesh("cpu", (1,))
        self.gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())

    def tearDown(self):
        dist.destroy_process_group()
        super().tearDown()

    def key(self, obj):
        return FxGraphCachePickler(self.gm).get_key(obj)

    def test_key_ignores_identity_without_opaque_objects(self):
        a, b = _equal_distinct_strings()
        self.assertEqual(self.key((a, a)), self.key((a, b)))

    def test_key_ignores_identity_after_device_mesh(self):
        fake_mesh = maybe_to_fake_obj(FakeTensorMode(), self.mesh)
        a, b = _equal_distinct_strings()
        # the same details, one string object seen twice or two equal strings
        self.assertEqual(self.key((fake_mesh, a, a)), self.key((fake_mesh, a, b)))


if __name__ == "__main__":
    run_tests()
