"""pytest configuration: the hypothesis profiles, and the native CPU kernel's build.

* ``ci`` (``.ci/run`` sets ``HYPOTHESIS_PROFILE=ci``): 200 random examples per property
  (a new seed every run), failing examples saved to the example database
  (``.hypothesis/``) and replayed first on the next run;
* ``dev`` (the default): 20 random examples, for a quick local run;
* ``full``: 1000 examples, for a soak before a release
  (``HYPOTHESIS_PROFILE=full python -m pytest test/test_property.py``).

Deadlines are off: the float64 oracles are Python loops whose time depends on the drawn
shape. A failure prints the ``@reproduce_failure`` blob and the shrunk example; add the
example to the test as an explicit ``@example`` regression case.

The native CPU SwiGLU kernel (``torch_moe/_ops/_native.py``) compiles on a machine's
first use, about 10 s: each pytest process starts it in a thread while the tests are
collected, so that the first test to need it waits less (a second process waits on the
first's build lock, then loads the result).
"""

import os
import threading

# NB: torch.testing._internal.common_utils registers its own profiles on import ("dev":
# 10 examples; "pytorch_ci" when CI is set: 50 derandomized examples, no database) and
# loads one. Import it first so that ours, loaded after, are the ones in force.
import torch.testing._internal.common_utils  # noqa: F401
from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

_COMMON = dict(
    deadline=None,
    # differing_executors: unittest makes a TestCase instance per run, and mutmut runs a
    # test several times in one process
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.differing_executors],
    derandomize=False,
    database=DirectoryBasedExampleDatabase(".hypothesis/examples"),
)
PROFILES = {
    "ci": dict(max_examples=200, print_blob=True),
    "dev": dict(max_examples=20),
    "full": dict(max_examples=1000, print_blob=True),
}
for _name, _kw in PROFILES.items():
    settings.register_profile(f"torch_moe_{_name}", **_kw, **_COMMON)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "dev")
if PROFILE not in PROFILES:
    raise ValueError(f"HYPOTHESIS_PROFILE must be one of {sorted(PROFILES)}, got {PROFILE!r}")
settings.load_profile(f"torch_moe_{PROFILE}")


def _start_native_build() -> None:
    """Build the native CPU kernels in a thread while pytest collects. Reads the switch
    itself and calls nothing of the library here: under mutation testing every library
    function may raise, and that must fail tests, not this conftest's import."""
    from torch_moe._ops import _native

    if os.environ.get(_native.ENV, "1") != "0":
        threading.Thread(target=_native.kernels, name="torch_moe-native-build", daemon=True).start()


_start_native_build()
