"""Check the upstream patch series against the installed torch.

    python upstream_patches/check.py                 # everything (CI)
    python upstream_patches/check.py --format-only   # headers, Test Plan, diffs parse (fast)
    python upstream_patches/check.py --series 0001-grouped-mm-meta

For each series (a folder ``NNNN-<slug>/`` here, in order) and each patch in it
(``NNNN-<title>.patch``, ``git format-patch`` output, paths as in the PyTorch repo):

1. format: format-patch headers, ``Subject: [PATCH ...] [Tag] title``, a
   ``Test Plan:`` section, a diff that ``git apply --stat`` parses, and a test file
   ``tests/test_NNNN_*.py``;
2. apply: the files the series touches that the installed wheel ships
   (``torch/**/*.py``) are copied into a scratch git tree, and the patches are
   applied there in order (``git apply --check`` then ``git apply``), so patch N is
   tested on top of patches 1..N-1. Files the wheel does not ship (C++, yaml) make
   a patch "not testable here": only its format is checked;
3. tests: each test runs twice in a subprocess with pytest: against stock torch,
   where it must FAIL (the bug is real on the pinned release), and, for testable
   patches, against torch with the patched files served by an import overlay
   (``_overlay.py``: a ``sys.meta_path`` finder; nothing is copied into
   site-packages), where it must PASS.

Exit status 1 if anything that should hold does not, 0 otherwise. The pinned
release is ``PYTORCH_VERSION`` (version, then ``torch.version.git_version``); a
different installed torch is an error unless ``--allow-version-mismatch``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OVERLAY = HERE / "_overlay.py"

_FROM_LINE = re.compile(r"^From [0-9a-f]{40} Mon Sep 17 00:00:00 2001$")
_SUBJECT = re.compile(r"^Subject: \[PATCH(?: \d+/\d+)?\] (\[[A-Za-z0-9_. /-]+\] .+)$", re.M)
_PYTEST_SUMMARY = re.compile(r"^=*\s*(\d+ (?:passed|failed|error).*?)\s*=*$", re.M)


@dataclasses.dataclass
class Result:
    name: str
    title: str = ""
    problems: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    testable: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems


def read_pinned(path: Path = HERE / "PYTORCH_VERSION") -> tuple[str, str]:
    lines = [ln.strip() for ln in path.read_text().splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    if len(lines) != 2 or not re.fullmatch(r"[0-9a-f]{40}", lines[1]):
        raise SystemExit(f"{path}: expected a version line and a 40-hex git commit, got {lines}")
    return lines[0], lines[1]


def torch_site() -> Path:
    """The directory holding the installed ``torch`` package (no import of torch here)."""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import importlib.util as u; print(u.find_spec('torch').submodule_search_locations[0])",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip()).parent


def installed_version() -> tuple[str, str]:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch; print(torch.__version__); print(torch.version.git_version)",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    version, git = out.stdout.split()[-2:]
    return version.split("+")[0], git


def git(
    *args: str, cwd: Path | None = None, stdin: str | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, input=stdin, capture_output=True, text=True)


def touched_files(patch: Path) -> list[str]:
    out = git("apply", "--numstat", str(patch.resolve()))
    return [ln.split("\t", 2)[2] for ln in out.stdout.splitlines() if ln.count("\t") >= 2]


def check_format(patch: Path, result: Result) -> None:
    text = patch.read_text()
    first = text.splitlines()[0] if text else ""
    if not _FROM_LINE.match(first):
        result.problems.append(
            "not git format-patch output (first line is not 'From <sha> Mon Sep 17 ...')"
        )
    for header in ("From: ", "Date: "):
        if not re.search(rf"^{header}", text, re.M):
            result.problems.append(f"missing '{header.strip()}' header")
    headers = text.split("\n\n", 1)[0].replace("\n ", " ")  # unfold RFC 2822 headers
    subject = _SUBJECT.search(headers)
    if subject is None:
        result.problems.append("missing 'Subject: [PATCH] [Tag] title' (an upstream-style [Tag])")
    else:
        result.title = subject.group(1)
    message = text.split("\n---\n", 1)[0]
    if not re.search(r"^Test Plan:", message, re.M):
        result.problems.append("commit message has no 'Test Plan:' section")
    stat = git("apply", "--stat", str(patch.resolve()))
    if stat.returncode != 0:
        result.problems.append(f"git apply --stat cannot parse the diff: {stat.stderr.strip()}")
    elif not touched_files(patch):
        result.problems.append("the patch touches no file")
    if test_file(patch) is None:
        result.problems.append(f"no test file tests/test_{patch.name[:4]}_*.py")


def test_file(patch: Path) -> Path | None:
    found = sorted((patch.parent / "tests").glob(f"test_{patch.name[:4]}_*.py"))
    return found[0] if len(found) == 1 else None


def run_pytest(test: Path, overlay_root: Path | None) -> tuple[int, str]:
    cmd = [sys.executable]
    if overlay_root is not None:
        cmd += [str(OVERLAY), str(overlay_root)]
    cmd += [
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--rootdir",
        str(test.parent),
        str(test),
    ]
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTORCH_PRINT_REPRO_ON_FAILURE="0")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=test.parent)
    summaries = _PYTEST_SUMMARY.findall(proc.stdout)
    summary = summaries[-1] if summaries else (proc.stdout + proc.stderr).strip()[-300:]
    return proc.returncode, summary


def check_series(series: Path, site: Path, format_only: bool) -> list[Result]:
    patches = sorted(series.glob("[0-9][0-9][0-9][0-9]-*.patch"))
    results = [Result(name=f"{series.name}/{p.name}") for p in patches]
    for patch, result in zip(patches, results):
        check_format(patch, result)
    if format_only:
        return results

    scratch = Path(tempfile.mkdtemp(prefix="upstream_patches_"))
    try:
        tree = scratch / "tree"
        tree.mkdir()
        git("init", "-q", cwd=tree)
        for patch in patches:
            for rel in touched_files(patch):
                if (site / rel).is_file() and not (tree / rel).exists():
                    (tree / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(site / rel, tree / rel)
        for n, (patch, result) in enumerate(zip(patches, results)):
            files = touched_files(patch)
            in_wheel = [f for f in files if (site / f).is_file()]
            result.testable = (
                bool(files)
                and len(in_wheel) == len(files)
                and all(f.endswith(".py") for f in files)
            )
            if in_wheel:
                include = [f"--include={f}" for f in in_wheel]
                check = git("apply", "--check", *include, str(patch.resolve()), cwd=tree)
                if check.returncode != 0:
                    result.problems.append(
                        f"does not apply to the installed torch: {check.stderr.strip()}"
                    )
                    result.testable = False
                else:
                    git("apply", *include, str(patch.resolve()), cwd=tree)
                    result.notes.append(f"applies ({', '.join(in_wheel)})")
            if not result.testable:
                outside = [f for f in files if f not in in_wheel]
                result.notes.append(
                    f"not testable here: {', '.join(outside) or 'does not apply'} not in the wheel"
                )
            test = test_file(patch)
            if test is None:
                continue
            rc, summary = run_pytest(test, None)
            if rc == 1:
                result.notes.append(f"stock torch: FAILS as expected ({summary})")
            else:
                result.problems.append(
                    f"stock torch: expected the test to fail, got rc={rc} ({summary})"
                )
            if result.testable:
                snapshot = scratch / f"after_{n + 1:04d}"
                shutil.copytree(tree, snapshot, ignore=shutil.ignore_patterns(".git"))
                rc, summary = run_pytest(test, snapshot)
                if rc == 0:
                    result.notes.append(f"patched torch: PASSES ({summary})")
                else:
                    result.problems.append(
                        f"patched torch: expected the test to pass, got rc={rc} ({summary})"
                    )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--format-only", action="store_true", help="only check headers, Test Plan and diffs"
    )
    parser.add_argument("--series", action="append", help="only this series folder (repeatable)")
    parser.add_argument("--allow-version-mismatch", action="store_true")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    pinned = read_pinned()
    failed = False
    if not args.format_only:
        installed = installed_version()
        print(
            f"pinned torch {pinned[0]} ({pinned[1][:12]}), installed {installed[0]} ({installed[1][:12]})"
        )
        if installed != pinned:
            print("  installed torch differs from PYTORCH_VERSION", file=sys.stderr)
            failed = not args.allow_version_mismatch
    site = torch_site() if not args.format_only else Path()
    series_dirs = sorted(p for p in HERE.iterdir() if p.is_dir() and re.match(r"\d{4}-", p.name))
    if args.series:
        series_dirs = [p for p in series_dirs if p.name in args.series]
    if not series_dirs:
        print("no patch series found", file=sys.stderr)
        return 1
    for series in series_dirs:
        print(f"\n{series.name}")
        for result in check_series(series, site, args.format_only):
            status = "ok" if result.ok else "FAIL"
            print(f"  [{status}] {result.name}")
            if result.title:
                print(f"         {result.title}")
            for note in result.notes:
                print(f"         {note}")
            for problem in result.problems:
                print(f"         PROBLEM: {problem}")
            failed = failed or not result.ok
    print(f"\n{'FAILED' if failed else 'OK'} in {time.perf_counter() - start:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
