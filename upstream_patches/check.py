"""Check the upstream patch series against the pinned torch.

    python upstream_patches/check.py                 # everything (CI)
    python upstream_patches/check.py --format-only   # headers, messages, diffs, index lines
    python upstream_patches/check.py --series 0001-meta-grouped-mm

Each folder ``NNNN-<area>-<slug>/`` here is one upstream PR (a ghstack of its
patches) or one upstream issue:

* ``NNNN-<title>.patch``: ``git format-patch`` output with paths as in the PyTorch
  repository. Each patch carries its test inside the diff, at the path where it
  lands upstream (``test/...``), and a message with ``Summary:``, ``Test Plan:``
  and a ``Fixes #N`` / ``Related #N`` line (or says that no upstream issue exists).
* ``ISSUE.md``: an issue to file where no patch is proposed; tests under ``test/``
  in the folder (same paths as upstream) show the problem on the pinned release.

What is checked:

1. format: format-patch headers, ``Subject: [PATCH ...] [Tag] title``, the message
   sections, a diff that ``git apply --stat`` parses, a test file in the diff, and
   the ``index`` line of every file the patch modifies: its pre-image must be the
   real upstream blob, the installed wheel's file for ``torch/**/*.py`` (the wheel
   ships the sources of ``PYTORCH_VERSION``), the blob listed in
   ``UPSTREAM_SOURCES`` for native files (C++, yaml), so ``git am -3`` can fall back
   to a three-way merge in a PyTorch checkout;
2. apply: per series, a scratch git tree holds those files (native ones from the
   upstream source cache, see ``--upstream-src``; their blob id is verified) and the
   patches are applied in order with ``git apply``;
3. tests: the tests a patch adds (its new ``Test*`` classes) run against the stock
   installed torch, where they must FAIL, and, for a patch that touches only
   ``torch/**/*.py``, against torch with the patched files served by an import
   overlay (``_overlay.py``: a ``sys.meta_path`` finder, nothing is copied into
   site-packages), where they must PASS. A native patch cannot be built here: it is
   checked to apply to the upstream file and its test to fail on stock torch.

One line per patch: ``applied``, ``failed before``, ``passed after``, or
``native: applies to upstream <commit>, not compiled``. The stock runs of all series
share one pytest process and the patched runs go in parallel: about 70 s of CPU in all,
about a minute of wall time on an idle 2-core machine. Exit status 1 if anything that should hold
does not.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
OVERLAY = HERE / "_overlay.py"
UPSTREAM_SOURCES = HERE / "UPSTREAM_SOURCES"
DEFAULT_UPSTREAM_SRC = Path(
    os.environ.get("TORCH_MOE_UPSTREAM_SRC", Path.home() / ".cache" / "torch_moe" / "upstream")
)

_FROM_LINE = re.compile(r"^From [0-9a-f]{40} Mon Sep 17 00:00:00 2001$")
_SUBJECT = re.compile(r"^Subject: \[PATCH(?: \d+/\d+)?\] (\[[A-Za-z0-9_. /-]+\] .+)$", re.M)
_ISSUE_REF = re.compile(r"^(Fixes|Related) #\d+|^No upstream issue", re.M)
_POST = re.compile(r"^index [0-9a-f]+\.\.([0-9a-f]+)", re.M)
_INDEX = re.compile(
    r"^diff --git a/(\S+) b/\S+\n(?:(?:new|deleted) file mode \d+\n)?index ([0-9a-f]+)\.\.", re.M
)
_ADDED_CLASS = re.compile(r"^\+class (Test\w+)\(", re.M)
_CLASS = re.compile(r"^class (Test\w+)\(", re.M)
_ZERO = re.compile(r"^0+$")


@dataclasses.dataclass
class Result:
    """What the checker found for one patch (or one issue folder)."""

    name: str
    title: str = ""
    kind: str = "python"  # python | native | issue
    problems: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    status: list[str] = dataclasses.field(default_factory=list)  # the one-line summary
    test_files: list[str] = dataclasses.field(default_factory=list)
    test_classes: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


# ---------------------------------------------------------------------------- helpers


def read_pinned(path: Path = HERE / "PYTORCH_VERSION") -> tuple[str, str]:
    lines = [ln.strip() for ln in path.read_text().splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    if len(lines) != 2 or not re.fullmatch(r"[0-9a-f]{40}", lines[1]):
        raise SystemExit(f"{path}: expected a version line and a 40-hex git commit, got {lines}")
    return lines[0], lines[1]


def read_upstream_sources(path: Path = UPSTREAM_SOURCES) -> dict[str, tuple[str, str]]:
    """``path -> (commit, blob)`` of the native files the series were made against."""
    sources: dict[str, tuple[str, str]] = {}
    if not path.is_file():
        return sources
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != 3 or not all(re.fullmatch(r"[0-9a-f]{40}", f) for f in fields[:2]):
            raise SystemExit(f"{path}:{n}: expected '<commit> <blob> <path>', got {line!r}")
        sources[fields[2]] = (fields[0], fields[1])
    return sources


def _python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def torch_site() -> Path:
    """The directory holding the installed ``torch`` package (torch is not imported here)."""
    code = "import importlib.util as u; print(u.find_spec('torch').submodule_search_locations[0])"
    return Path(_python(code)).parent


def installed_version() -> tuple[str, str]:
    version, git_version = _python(
        "import torch; print(torch.__version__); print(torch.version.git_version)"
    ).split()[-2:]
    return version.split("+")[0], git_version


def git(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)


def blob_id(path: Path) -> str:
    out = git("hash-object", "--no-filters", str(path))
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    return out.stdout.strip()


def touched_files(patch: Path) -> list[str]:
    out = git("apply", "--numstat", str(patch.resolve()))
    return [ln.split("\t", 2)[2] for ln in out.stdout.splitlines() if ln.count("\t") >= 2]


def pre_image_blobs(text: str) -> dict[str, str]:
    """``path -> abbreviated pre-image blob`` from the diff's ``index`` lines (0... = new)."""
    return {m.group(1): m.group(2) for m in _INDEX.finditer(text)}


def is_test_path(path: str) -> bool:
    return path.startswith("test/") and path.endswith(".py")


def is_native(path: str) -> bool:
    return not (path.startswith("torch/") and path.endswith(".py")) and not is_test_path(path)


def upstream_file(rel: str, commit: str, upstream_src: Path) -> Path | None:
    """The upstream source of ``rel`` at ``commit``: ``<src>/<commit>/<rel>``, or a
    PyTorch git checkout at ``<src>`` that has the commit."""
    cached = upstream_src / commit / rel
    if cached.is_file():
        return cached
    if (upstream_src / ".git").exists():
        out = subprocess.run(
            ["git", "-C", str(upstream_src), "show", f"{commit}:{rel}"], capture_output=True
        )
        if out.returncode == 0:
            tmp = Path(tempfile.mkdtemp(prefix="upstream_src_")) / Path(rel).name
            tmp.write_bytes(out.stdout)
            return tmp
    return None


# ----------------------------------------------------------------------------- format


def check_format(
    patch: Path, result: Result, site: Path | None = None, earlier: set[str] | None = None
) -> None:
    """Headers, message sections, diff, test in the diff, real pre-image blobs."""
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
    for section in ("Summary:", "Test Plan:"):
        if not re.search(rf"^{section}", message, re.M):
            result.problems.append(f"commit message has no '{section}' section")
    if not _ISSUE_REF.search(message):
        result.problems.append(
            "commit message has no 'Fixes #N' / 'Related #N' line (or 'No upstream issue ...')"
        )
    stat = git("apply", "--stat", str(patch.resolve()))
    if stat.returncode != 0:
        result.problems.append(f"git apply --stat cannot parse the diff: {stat.stderr.strip()}")
        return
    files = touched_files(patch)
    if not files:
        result.problems.append("the patch touches no file")
    result.test_files = [f for f in files if is_test_path(f)]
    if not result.test_files:
        result.problems.append("no test in the diff (a test/**/*.py file at its upstream path)")
    result.test_classes = sorted(set(_ADDED_CLASS.findall(text)))
    if result.test_files and not result.test_classes:
        result.problems.append("the diff adds no 'class Test...(' to its test file")
    result.kind = "native" if any(is_native(f) for f in files) else "python"
    check_index_lines(text, files, result, site, earlier or set())


def check_index_lines(
    text: str, files: list[str], result: Result, site: Path | None, earlier: set[str]
) -> None:
    """The pre-image of each modified file is the upstream blob (``git am -3`` needs it),
    or the post-image of an earlier patch of the same series (``earlier``)."""
    sources = read_upstream_sources()
    pre = pre_image_blobs(text)
    for rel in files:
        abbrev = pre.get(rel)
        if abbrev is None:
            result.problems.append(f"{rel}: no 'index' line in the diff")
            continue
        if _ZERO.match(abbrev) or abbrev in earlier:
            continue  # a new file, or one an earlier patch of the series changed
        if rel in sources:
            expected = sources[rel][1]
        elif rel.startswith("torch/") and rel.endswith(".py"):
            if site is None or not (site / rel).is_file():
                continue  # --format-only without the wheel, or a file the wheel lacks
            expected = blob_id(site / rel)
        else:
            result.problems.append(
                f"{rel}: modified upstream file with no entry in UPSTREAM_SOURCES"
            )
            continue
        if not expected.startswith(abbrev):
            result.problems.append(
                f"{rel}: the diff's pre-image blob {abbrev} is not the upstream blob "
                f"{expected[:12]} (made against another file?)"
            )


# ------------------------------------------------------------------------------ tests


def run_pytest(
    tests: list[Path], overlay_root: Path | None, classes: list[str] | None, junit: Path
) -> tuple[int, str]:
    """Run pytest on ``tests`` (optionally only ``classes``) in a fresh interpreter."""
    cmd = [sys.executable]
    if overlay_root is not None:
        cmd += [str(OVERLAY), str(overlay_root)]
    cmd += ["-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    if classes:
        cmd += ["-k", " or ".join(classes)]
    cmd += [str(t) for t in tests]
    env = dict(
        os.environ,
        PYTHONDONTWRITEBYTECODE="1",
        PYTORCH_PRINT_REPRO_ON_FAILURE="0",
        TORCHINDUCTOR_CACHE_DIR=str(junit.parent / f"{junit.stem}_inductor_cache"),
    )
    # cwd: a folder without a torch/ package, so `python -m pytest` cannot import the tree's
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=junit.parent)
    return proc.returncode, (proc.stdout + proc.stderr)[-2000:]


def junit_outcomes(junit: Path) -> dict[str, list[tuple[str, str]]]:
    """``class name -> [(test name, outcome)]``, outcome in passed/failed/error/skipped."""
    outcomes: dict[str, list[tuple[str, str]]] = {}
    if not junit.is_file():
        return outcomes
    for case in ET.parse(junit).getroot().iter("testcase"):
        cls = case.get("classname", "").split(".")[-1]
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
        outcomes.setdefault(cls, []).append((case.get("name", ""), outcome))
    return outcomes


def class_outcomes(
    outcomes: dict[str, list[tuple[str, str]]], classes: list[str]
) -> list[tuple[str, str]]:
    """The results of ``classes``, including device-instantiated copies (``TestFooCPU``)."""
    picked = []
    for cls, cases in outcomes.items():
        if any(cls == c or re.fullmatch(rf"{c}[A-Z]+", cls) for c in classes):
            picked += cases
    return picked


def summarize(cases: list[tuple[str, str]]) -> str:
    counts: dict[str, int] = {}
    for _, outcome in cases:
        counts[outcome] = counts.get(outcome, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no tests ran"


# ----------------------------------------------------------------------------- series


@dataclasses.dataclass
class Series:
    folder: Path
    results: list[Result]
    patches: list[Path]
    tree: Path | None = None
    snapshots: list[Path | None] = dataclasses.field(default_factory=list)
    issue_tests: list[Path] = dataclasses.field(default_factory=list)


def load_series(folder: Path, site: Path | None) -> Series:
    patches = sorted(folder.glob("[0-9][0-9][0-9][0-9]-*.patch"))
    results = [Result(name=f"{folder.name}/{p.name}") for p in patches]
    earlier: set[str] = set()  # post-image blobs of the series' earlier patches
    for patch, result in zip(patches, results):
        check_format(patch, result, site, earlier)
        earlier |= set(_POST.findall(patch.read_text()))
    series = Series(folder=folder, results=results, patches=patches)
    if not patches:
        issue = Result(name=f"{folder.name}/ISSUE.md", kind="issue")
        if not (folder / "ISSUE.md").is_file():
            issue.problems.append("a series folder needs patches or an ISSUE.md")
        else:
            issue.title = (folder / "ISSUE.md").read_text().splitlines()[0].lstrip("# ")
        series.issue_tests = sorted((folder / "test").rglob("test_*.py"))
        series.results.append(issue)
    return series


def apply_series(
    series: Series,
    site: Path,
    upstream_src: Path,
    scratch: Path,
    require_upstream_src: bool = False,
) -> None:
    """Build the series' scratch tree and apply its patches; one snapshot per patch.

    A native file whose upstream copy is not available is left out of the apply (its
    pre-image blob was still checked against ``UPSTREAM_SOURCES`` by the format check):
    the patch's line says so, and it is a failure only with ``require_upstream_src``. A
    copy whose blob id differs is always a failure."""
    sources = read_upstream_sources()
    tree = scratch / series.folder.name / "tree"
    tree.mkdir(parents=True)
    git("init", "-q", cwd=tree)
    missing: dict[str, str] = {}  # native file -> why it is not in the tree
    absent: set[str] = set()  # the subset with no copy at all (not a wrong copy)
    for patch in series.patches:
        for rel in touched_files(patch):
            if (tree / rel).exists() or rel in missing:
                continue
            if rel in sources:
                commit, blob = sources[rel]
                src = upstream_file(rel, commit, upstream_src)
                if src is None:
                    missing[rel] = f"no copy of upstream {commit[:12]}:{rel} under {upstream_src}"
                    absent.add(rel)
                    continue
                if blob_id(src) != blob:
                    missing[rel] = f"{src} is not blob {blob[:12]} of upstream {commit[:12]}"
                    continue
            elif (site / rel).is_file():
                src = site / rel
            else:
                continue  # created by the patch
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, tree / rel)
    series.tree = tree
    for n, (patch, result) in enumerate(zip(series.patches, series.results)):
        files = touched_files(patch)
        excluded = [f for f in files if f in missing]
        args = [f"--exclude={f}" for f in excluded]
        check = git("apply", "--check", *args, str(patch.resolve()), cwd=tree)
        if check.returncode != 0:
            result.problems.append(f"does not apply: {check.stderr.strip()}")
            series.snapshots.append(None)
            continue
        git("apply", *args, str(patch.resolve()), cwd=tree)
        native = [f for f in files if f in sources]
        for rel in excluded:
            if rel in absent and not require_upstream_src:
                commit = sources[rel][0][:12]
                result.status.append(
                    f"native: made against upstream {commit} (blob checked), NOT re-applied "
                    "here: no copy of the file (see --upstream-src), not compiled"
                )
                result.notes.append(missing[rel])
            else:
                result.problems.append(f"native file not checked: {missing[rel]}")
        if native and not excluded:
            commits = sorted({sources[f][0][:12] for f in native})
            result.status.append(f"native: applies to upstream {', '.join(commits)}, not compiled")
            result.notes.append(f"applies to {', '.join(native)} (blob verified)")
        elif not native:
            result.status.append("applied")
        snapshot = scratch / series.folder.name / f"after_{n + 1:04d}"
        shutil.copytree(tree, snapshot, ignore=shutil.ignore_patterns(".git"))
        series.snapshots.append(snapshot)


def check_tests(all_series: list[Series], scratch: Path, jobs: int) -> None:
    """Stock runs (one process for every series), then the patched runs in parallel."""
    stock_files: list[Path] = []
    for series in all_series:
        for result, snapshot in zip(series.results, series.snapshots):
            if snapshot is not None:
                stock_files += [snapshot / f for f in result.test_files]
        stock_files += series.issue_tests
    # the last snapshot of a file holds the tests of every patch of its series
    latest: dict[str, Path] = {}
    for path in stock_files:
        latest[path.name] = path
    stock_dir = scratch / "stock"
    stock_dir.mkdir()
    stock_tests = []
    for name, path in sorted(latest.items()):
        shutil.copyfile(path, stock_dir / name)
        stock_tests.append(stock_dir / name)

    jobs_list: list[tuple[Result | None, list[Path], Path | None, list[str] | None, Path]] = []
    if stock_tests:
        jobs_list.append((None, stock_tests, None, None, scratch / "stock" / "junit.xml"))
    for series in all_series:
        for n, (result, snapshot) in enumerate(zip(series.results, series.snapshots)):
            if snapshot is None or result.kind != "python" or not result.test_classes:
                continue
            tests = [snapshot / f for f in result.test_files]
            junit = scratch / series.folder.name / f"junit_after_{n + 1:04d}.xml"
            jobs_list.append((result, tests, snapshot, result.test_classes, junit))

    def run(job):  # type: ignore[no-untyped-def]
        _, tests, overlay, classes, junit = job
        start = time.perf_counter()
        out = run_pytest(tests, overlay, classes, junit)
        if os.environ.get("CHECK_VERBOSE"):
            print(f"  [{time.perf_counter() - start:5.1f} s] {junit.parent.name}/{junit.name}")
        return out

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        finished = list(pool.map(run, jobs_list))

    stock = junit_outcomes(scratch / "stock" / "junit.xml") if stock_tests else {}
    for series in all_series:
        for result in series.results:
            if result.kind == "issue":
                if not series.issue_tests:
                    result.status.append("issue text only (no test)")
                    continue
                classes = sorted(
                    {c for t in series.issue_tests for c in _CLASS.findall(t.read_text())}
                )
                expect_failure(result, class_outcomes(stock, classes), "limitation shown")
                continue
            if not result.test_classes or result.problems:
                continue
            expect_failure(result, class_outcomes(stock, result.test_classes), "failed before")
    for job, (rc, tail) in zip(jobs_list, finished):
        result = job[0]
        if result is None:
            continue
        cases = class_outcomes(junit_outcomes(job[4]), result.test_classes)
        if rc == 0 and cases and all(o in ("passed", "skipped") for _, o in cases):
            result.status.append(f"passed after ({summarize(cases)})")
        else:
            result.problems.append(
                f"patched torch: expected the test to pass, got rc={rc} ({summarize(cases)})\n"
                + tail[-600:]
            )


def expect_failure(result: Result, cases: list[tuple[str, str]], label: str) -> None:
    failed = [name for name, outcome in cases if outcome in ("failed", "error")]
    if failed:
        result.status.append(f"{label} ({summarize(cases)} on stock torch)")
    else:
        result.problems.append(f"stock torch: expected a test to fail, got {summarize(cases)}")


# ------------------------------------------------------------------------------- main


def check_series(folder: Path, site: Path | None, format_only: bool) -> list[Result]:
    """Format check of one series (kept for test/test_upstream_patches.py)."""
    return load_series(folder, site if not format_only else None).results


def series_folders(names: list[str] | None = None) -> list[Path]:
    folders = sorted(p for p in HERE.iterdir() if p.is_dir() and re.match(r"\d{4}-", p.name))
    return [p for p in folders if not names or p.name in names]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--format-only", action="store_true", help="no apply, no tests")
    parser.add_argument("--series", action="append", help="only this series folder (repeatable)")
    parser.add_argument(
        "--upstream-src",
        type=Path,
        default=DEFAULT_UPSTREAM_SRC,
        help="native sources: <dir>/<commit>/<path>, or a PyTorch git checkout "
        f"(default: $TORCH_MOE_UPSTREAM_SRC or {DEFAULT_UPSTREAM_SRC})",
    )
    parser.add_argument(
        "--require-upstream-src",
        action="store_true",
        help="fail when a native patch cannot be re-applied (no copy of its upstream file)",
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--allow-version-mismatch", action="store_true")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    pinned = read_pinned()
    failed = False
    site: Path | None = None
    if not args.format_only:
        installed = installed_version()
        print(
            f"pinned torch {pinned[0]} ({pinned[1][:12]}), installed {installed[0]} "
            f"({installed[1][:12]})"
        )
        if installed != pinned:
            print("  installed torch differs from PYTORCH_VERSION", file=sys.stderr)
            failed = not args.allow_version_mismatch
        site = torch_site()
    folders = series_folders(args.series)
    if not folders:
        print("no patch series found", file=sys.stderr)
        return 1
    all_series = [load_series(folder, site) for folder in folders]
    if not args.format_only:
        assert site is not None
        scratch = Path(tempfile.mkdtemp(prefix="upstream_patches_"))
        try:
            for series in all_series:
                apply_series(series, site, args.upstream_src, scratch, args.require_upstream_src)
            check_tests(all_series, scratch, args.jobs)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    for series in all_series:
        print(f"\n{series.folder.name}")
        for result in series.results:
            status = "; ".join(result.status) if result.status else "format ok"
            print(f"  [{'ok' if result.ok else 'FAIL'}] {result.name}: {status}")
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
