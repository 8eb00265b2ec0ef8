#!/usr/bin/env bash
# Mutation testing of torch_moe with mutmut 3 (pinned in setup.py's "test" extra); the scope
# and the tests it runs are in setup.cfg [mutmut]. Too slow for CI (about an hour on 2 cores):
# run it by hand after changing an op or its tests, and update
# benchmarks/results/mutation_cpu_<yyyymm>.md with its summary.
#
#   benchmarks/run_mutation.sh                 # HEAD, every mutant (results kept in the workdir)
#   benchmarks/run_mutation.sh --worktree      # the working tree instead of HEAD
#   benchmarks/run_mutation.sh NAME...         # re-run these mutants only (e.g. the survivors;
#                                              # fnmatch patterns work: 'torch_moe._ops.permute.*')
#   benchmarks/run_mutation.sh --sample 500    # a uniform random sample (--seed, default 0) of
#                                              # the mutants: an unbiased estimate of the score
#                                              # in about a tenth of the time
#   benchmarks/run_mutation.sh --report        # print the summary of the last run
#   mutmut show NAME  (in the workdir)         # the diff of one mutant
#
# It works on a copy (default /tmp/torch_moe_mutation): mutmut writes mutated sources under
# mutants/, and the checkout stays untouched. Every test process runs with one OpenMP thread
# (a forked child that inherits a used OpenMP pool can hang in its first parallel op) and
# under `nice -n 19`, so that a shared machine stays usable; --jobs sets how many mutants run
# at once (default 2). Hypothesis runs its "dev" profile (test/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
WORKDIR=${MUTATION_WORKDIR:-/tmp/torch_moe_mutation}
JOBS=2
SAMPLE=0
SEED=0
SOURCE=head
REPORT_ONLY=0
NAMES=()
while [ $# -gt 0 ]; do
  case $1 in
    --jobs) JOBS=$2; shift 2 ;;
    --sample) SAMPLE=$2; shift 2 ;;
    --seed) SEED=$2; shift 2 ;;
    --workdir) WORKDIR=$2; shift 2 ;;
    --worktree) SOURCE=worktree; shift ;;
    --report) REPORT_ONLY=1; shift ;;
    -h|--help) sed -n 2,22p "$0"; exit 0 ;;
    *) NAMES+=("$1"); shift ;;
  esac
done

python -c "import mutmut" 2>/dev/null || { echo "mutmut missing: pip install -e .[test]"; exit 1; }
mkdir -p "$WORKDIR"
if [ "$REPORT_ONLY" = 0 ]; then
  # refresh the sources and tests in the copy; keep mutants/ (mutmut's results) between runs
  find "$WORKDIR" -mindepth 1 -maxdepth 1 ! -name mutants ! -name "mutants_*.txt" -exec rm -rf {} +
  if [ "$SOURCE" = head ]; then
    git -C "$REPO" archive HEAD | tar -x -C "$WORKDIR"
  else
    git -C "$REPO" ls-files -z --cached --others --exclude-standard \
      | (cd "$REPO" && xargs -0 cp --parents -t "$WORKDIR" 2>/dev/null || true)
  fi
  echo "mutmut: $(python -c 'import importlib.metadata as m; print(m.version("mutmut"))'), \
source: $SOURCE ($(git -C "$REPO" rev-parse --short HEAD)), workdir: $WORKDIR, jobs: $JOBS"
  lscpu | grep -E "Model name" || true
  (
    cd "$WORKDIR"
    export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HYPOTHESIS_PROFILE=dev PYTHONHASHSEED=0
    start=$(date +%s)
    if [ "$SAMPLE" != 0 ] && [ ${#NAMES[@]} = 0 ]; then
      # generate every mutant (and the test statistics) by running the three of _dtypes.py,
      # then draw the sample from the full list
      nice -n 19 mutmut run --max-children "$JOBS" 'torch_moe._ops._dtypes.*' \
        >mutmut_generate.log 2>&1 || { tail -c 3000 mutmut_generate.log; exit 1; }
      mutmut results --all true 2>/dev/null | sed -E 's/^ *([^:]+):.*/\1/' >mutants_all.txt
      python -c "import random, sys; names = open('mutants_all.txt').read().split(); \
random.seed(int(sys.argv[2])); print('\n'.join(sorted(random.sample(names, \
min(int(sys.argv[1]), len(names))))))" "$SAMPLE" "$SEED" >mutants_sample.txt
      mapfile -t NAMES <mutants_sample.txt
      echo "sample: ${#NAMES[@]} of $(wc -l <mutants_all.txt) mutants (seed $SEED)"
    fi
    nice -n 19 mutmut run --max-children "$JOBS" "${NAMES[@]}" >mutmut_run.log 2>&1 || {
      tail -c 3000 mutmut_run.log; exit 1; }
    echo "mutmut run: $(( $(date +%s) - start )) s"
  )
fi

# summary: per file, killed / survived / no tests / timeout / other, and the survivors
cd "$WORKDIR"
mutmut results --all true >mutmut_results.txt 2>/dev/null || true
python - <<'PY'
import collections
import os
import re

sample = set(open("mutants_sample.txt").read().split()) if os.path.exists("mutants_sample.txt") else None

rows = collections.defaultdict(collections.Counter)
survivors = []
for line in open("mutmut_results.txt"):
    m = re.match(r"\s*(\S+): (.+)$", line)
    if not m:
        continue
    name, status = m.groups()
    if sample is not None and name not in sample:
        continue
    module = name.split(".x_")[0].split(".xǁ")[0]
    rows[module][status] += 1
    if status in ("survived", "no tests", "timeout", "suspicious"):
        survivors.append((status, name))
cols = ["killed", "survived", "no tests", "timeout", "suspicious", "not checked"]
print("| module | mutants | " + " | ".join(cols) + " | score |")
print("|---" * (len(cols) + 3) + "|")
total = collections.Counter()
for module in sorted(rows):
    c = rows[module]
    total.update(c)
    n = sum(c.values())
    checked = n - c["not checked"]
    score = f"{100 * c['killed'] / checked:.1f}%" if checked else "-"
    print(f"| {module} | {n} | " + " | ".join(str(c[k]) for k in cols) + f" | {score} |")
n = sum(total.values())
checked = n - total["not checked"]
score = f"{100 * total['killed'] / checked:.1f}%" if checked else "-"
print(f"| **all** | {n} | " + " | ".join(str(total[k]) for k in cols) + f" | {score} |")
print()
for status, name in sorted(survivors):
    print(f"{status}: {name}")
PY
