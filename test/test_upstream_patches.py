"""Fast checks of upstream_patches/: formats, index lines, the checker's logic, the overlay.

The full check (apply every series, run each patch's test against stock and patched
torch) is ``python upstream_patches/check.py``, run by .ci/run (about a minute).
"""

import importlib.util
import subprocess
import sys
import tempfile
import unittest
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
SITE = check.torch_site()


def _first_patch(series_prefix):
    return next(ROOT.glob(f"{series_prefix}*/0001-*.patch"))


class TestUpstreamPatches(TestCase):
    def test_pinned_version(self):
        version, commit = check.read_pinned()
        self.assertRegex(version, r"^\d+\.\d+\.\d+$")
        self.assertRegex(commit, r"^[0-9a-f]{40}$")

    def test_every_series_is_well_formed(self):
        folders = check.series_folders()
        self.assertGreaterEqual(len(folders), 7)
        for folder in folders:
            results = check.check_series(folder, SITE, format_only=False)
            self.assertTrue(results, folder.name)
            for result in results:
                self.assertTrue(result.ok, f"{result.name}: {result.problems}")
                if result.kind != "issue":
                    self.assertRegex(result.title, r"^\[\w+\] ")
                    self.assertTrue(result.test_classes, result.name)
                    self.assertTrue(all(f.startswith("test/") for f in result.test_files))

    def test_native_files_are_listed(self):
        sources = check.read_upstream_sources()
        natives = [
            f for p in ROOT.glob("*/*.patch") for f in check.touched_files(p) if check.is_native(f)
        ]
        self.assertTrue(natives)
        for rel in natives:
            self.assertIn(rel, sources)

    def test_checker_flags_missing_sections_and_test(self):
        patch = _first_patch("0001-")
        with tempfile.TemporaryDirectory() as tmp:
            bad = Path(tmp) / "0001-bad.patch"
            text = patch.read_text().replace("Test Plan:", "Testing:").replace("Summary:", "")
            bad.write_text(text)
            result = check.Result(name="bad")
            check.check_format(bad, result)
        self.assertIn("commit message has no 'Test Plan:' section", result.problems)
        self.assertIn("commit message has no 'Summary:' section", result.problems)

    def test_checker_flags_a_diff_without_its_test(self):
        patch = _first_patch("0004-")
        text = patch.read_text()
        head, diff = text.split("\ndiff --git ", 1)
        kept = [d for d in ("diff --git " + diff).split("\ndiff --git ") if "b/test/" not in d]
        with tempfile.TemporaryDirectory() as tmp:
            bad = Path(tmp) / "0001-bad.patch"
            bad.write_text(head + "\n" + "\ndiff --git ".join(kept))
            result = check.Result(name="bad")
            check.check_format(bad, result)
        self.assertIn(
            "no test in the diff (a test/**/*.py file at its upstream path)", result.problems
        )

    def test_checker_flags_a_foreign_pre_image(self):
        patch = _first_patch("0004-")
        text = patch.read_text()
        real = check.pre_image_blobs(text)["torch/nn/functional.py"]
        with tempfile.TemporaryDirectory() as tmp:
            bad = Path(tmp) / "0001-bad.patch"
            bad.write_text(text.replace(f"index {real}..", "index 1234567.."))
            result = check.Result(name="bad")
            check.check_format(bad, result, SITE)
        self.assertTrue(
            any("pre-image blob 1234567 is not the upstream blob" in p for p in result.problems),
            result.problems,
        )

    def test_class_outcomes_include_device_instantiations(self):
        outcomes = {
            "TestFooCPU": [("a", "failed")],
            "TestFooCUDA": [("a", "skipped")],
            "TestFoobar": [("b", "passed")],
        }
        picked = check.class_outcomes(outcomes, ["TestFoo"])
        self.assertEqual(sorted(o for _, o in picked), ["failed", "skipped"])
        self.assertEqual(check.summarize(picked), "1 failed, 1 skipped")

    @unittest.skipIf(
        not (check.DEFAULT_UPSTREAM_SRC).is_dir(), "no upstream source cache on this machine"
    )
    def test_native_patch_applies_to_the_cached_upstream_file(self):
        folder = next(ROOT.glob("0005-*"))
        series = check.load_series(folder, SITE)
        with tempfile.TemporaryDirectory() as tmp:
            check.apply_series(series, SITE, check.DEFAULT_UPSTREAM_SRC, Path(tmp))
        (result,) = series.results
        self.assertTrue(result.ok, result.problems)
        self.assertRegex(
            result.status[0], r"^native: applies to upstream [0-9a-f]{12}, not compiled"
        )

    def test_native_patch_without_or_with_a_wrong_upstream_copy(self):
        folder = next(ROOT.glob("0005-*"))
        (rel,) = [
            f for f in check.touched_files(next(folder.glob("*.patch"))) if check.is_native(f)
        ]
        commit, _ = check.read_upstream_sources()[rel]
        with tempfile.TemporaryDirectory() as tmp:
            # no copy: said on the patch's line, a failure only when required
            series = check.load_series(folder, SITE)
            check.apply_series(series, SITE, Path(tmp) / "none", Path(tmp) / "a")
            (result,) = series.results
            self.assertTrue(result.ok, result.problems)
            self.assertIn("NOT re-applied", result.status[0])
            series = check.load_series(folder, SITE)
            check.apply_series(series, SITE, Path(tmp) / "none", Path(tmp) / "b", True)
            self.assertFalse(series.results[0].ok)
            # a copy that is not the upstream blob: always a failure
            wrong = Path(tmp) / "cache" / commit / rel
            wrong.parent.mkdir(parents=True)
            wrong.write_text("// not the upstream file\n")
            series = check.load_series(folder, SITE)
            check.apply_series(series, SITE, Path(tmp) / "cache", Path(tmp) / "c")
            (result,) = series.results
            self.assertTrue(any("is not blob" in p for p in result.problems), result.problems)

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
