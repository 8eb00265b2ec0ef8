"""Fast checks of upstream_patches/: formats, the pinned version and the import overlay.

The full check (apply every patch, run each patch's test against stock and patched
torch) is ``python upstream_patches/check.py``, run by .ci/run (~2 min here).
"""

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

from torch.testing._internal.common_utils import TestCase, run_tests

ROOT = Path(__file__).resolve().parents[1] / "upstream_patches"


def _load_checker():
    spec = importlib.util.spec_from_file_location("upstream_patches_check", ROOT / "check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up
    spec.loader.exec_module(module)
    return module


check = _load_checker()


class TestUpstreamPatches(TestCase):
    def test_pinned_version(self):
        version, commit = check.read_pinned()
        self.assertRegex(version, r"^\d+\.\d+\.\d+$")
        self.assertRegex(commit, r"^[0-9a-f]{40}$")

    def test_every_patch_is_well_formed(self):
        series = sorted(p for p in ROOT.iterdir() if p.is_dir() and p.name[:4].isdigit())
        self.assertTrue(series)
        for folder in series:
            for result in check.check_series(folder, Path(), format_only=True):
                self.assertTrue(result.ok, f"{result.name}: {result.problems}")
                self.assertRegex(result.title, r"^\[\w+\] ")

    def test_checker_flags_missing_test_plan(self):
        patch = next(ROOT.glob("0001-*/0001-*.patch"))
        with tempfile.TemporaryDirectory() as tmp:
            bad = Path(tmp) / "0001-bad.patch"
            bad.write_text(patch.read_text().replace("Test Plan:", "Testing:"))
            result = check.Result(name="bad")
            check.check_format(bad, result)
        self.assertIn("commit message has no 'Test Plan:' section", result.problems)
        self.assertIn("no test file tests/test_0001_*.py", result.problems)

    def test_overlay_serves_patched_module(self):
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "torch").mkdir()
            (Path(tmp) / "torch" / "_overlay_probe.py").write_text("PATCHED = True\n")
            code = "import torch, torch._overlay_probe as p; print(p.PATCHED, torch.__file__)"
            # the overlay runs a module (-m): write one next to the overlay root
            (Path(tmp) / "runpy_probe.py").write_text(code + "\n")
            out = subprocess.run(
                [sys.executable, str(ROOT / "_overlay.py"), tmp, "-m", "runpy_probe"],
                capture_output=True,
                text=True,
                cwd=tmp,
            )
        self.assertEqual(out.returncode, 0, out.stderr)
        served, torch_file = out.stdout.split()
        self.assertEqual(served, "True")
        self.assertNotIn(tmp, torch_file)  # the rest of torch is the installed wheel


if __name__ == "__main__":
    run_tests()
