#!/usr/bin/env python3
"""Judge the output of libiscsi's iscsi-test-cu (CUnit "verbose" mode).

Used by scripts/conformance.sh. Each LOG argument is the captured stdout+stderr
of one iscsi-test-cu run, with its exit status: LOG:STATUS.

Verdict rules (any one fails the run, exit status 1):
  * a test CUnit marks FAILED (CUnit's verdict is authoritative: libiscsi's
    helpers also print "[FAILED]" when a test deliberately probes for an
    optional feature, e.g. WriteSame10.UnmapVPD, so such messages in a test
    CUnit passed are only listed as notes);
  * a suite whose initialisation failed (e.g. login failed), or any CUnit
    summary count of failed suites/tests/asserts or inactive tests;
  * a run without a CUnit "Run Summary" (crash, abort, timeout) or with a
    non-zero exit status that the parsed results do not explain;
  * a run that executed no test at all (a typo in conformance/suites.txt);
  * a skipped test (libiscsi prints "[SKIPPED]", "Skipping test" or
    "... is not implemented" and then lets CUnit mark it passed) whose
    SUITE.TEST name matches no pattern in the waivers file;
  * a waiver no skipped test used (the test now runs, or the pattern has a
    typo), unless --allow-unused-waivers (runs of a subset of the tests);
  * our own count of tests disagreeing with CUnit's summary (the parser is
    out of step with the tool's output format; never guess).

Waivers file: one `PATTERN  # reason` per line, PATTERN a shell glob over
SUITE.TEST (e.g. `Inquiry.BlockLimits`, `CompareAndWrite.*`); the reason is
mandatory. `PATTERN partial  # reason` is for a test that skips one part
(prints a skip message) and runs and checks the rest: it counts as passed.
Blank lines and lines starting with # are ignored.

`cunit_report.py --self-test` checks these rules on built-in samples.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import re
import sys
from dataclasses import dataclass, field

SUITE_RE = re.compile(r"^Suite: (.+?)\s*$")
TEST_RE = re.compile(r"^  Test: (.+?) \.\.\.(.*)$")
RESULT_RE = re.compile(r"^(passed|FAILED)(.*)$")
ASSERT_RE = re.compile(r"^    \d+\. \S+:\d+\s+- ")
INIT_FAIL_RE = re.compile(r"Suite (?:initialization|cleanup) failed for '([^']*)'", re.I)
SKIP_RE = re.compile(r"\[SKIPPED\]|Skipping test|not implemented", re.I)
FAILMSG_RE = re.compile(r"\[FAILED\]")
ROW_RE = re.compile(r"^\s*(suites|tests|asserts)\s+(\d+)\s+(\d+)\s+(\S+)\s+(\d+)\s+(\S+)\s*$")


@dataclass
class Test:
    suite: str
    name: str
    result: str | None = None  # "passed" / "FAILED" as printed by CUnit
    messages: list[str] = field(default_factory=list)  # printed before the result
    asserts: list[str] = field(default_factory=list)  # CUnit failure records
    after: list[str] = field(default_factory=list)  # printed after the result

    @property
    def key(self) -> str:
        return f"{self.suite}.{self.name}"

    @property
    def logged_failure(self) -> bool:
        return any(FAILMSG_RE.search(m) for m in self.messages)

    @property
    def skip_reason(self) -> str | None:
        for m in self.messages:
            if SKIP_RE.search(m):
                return m.strip()
        return None

    @property
    def status(self) -> str:
        if self.result != "passed":
            return "failed"
        return "skipped" if self.skip_reason else "passed"


@dataclass
class Run:
    label: str
    exit_status: int
    tests: list[Test] = field(default_factory=list)
    summary: dict[str, list[str]] = field(default_factory=dict)
    init_failures: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # run-level failures
    notes: list[str] = field(default_factory=list)  # worth a look, not failures
    tail: list[str] = field(default_factory=list)


def parse(text: str, label: str, exit_status: int) -> Run:
    run = Run(label=label, exit_status=exit_status)
    lines = text.splitlines()
    run.tail = lines[-15:]
    suite = "?"
    cur: Test | None = None
    in_summary = False
    for line in lines:
        if line.startswith("Run Summary:"):
            in_summary = True
            cur = None
            continue
        if in_summary:
            m = ROW_RE.match(line)
            if m:
                run.summary[m.group(1)] = list(m.group(2, 3, 4, 5, 6))
            continue
        m = INIT_FAIL_RE.search(line)
        if m:
            run.init_failures.append(m.group(1))
        m = SUITE_RE.match(line)
        if m:
            suite, cur = m.group(1), None
            continue
        m = TEST_RE.match(line)
        if m:
            cur = Test(suite=suite, name=m.group(1))
            run.tests.append(cur)
            rest = m.group(2)
            r = RESULT_RE.match(rest)
            if r:
                cur.result = r.group(1)
                if r.group(2).strip():
                    cur.after.append(r.group(2))
            elif rest.strip():
                cur.messages.append(rest)
            continue
        if cur is None:
            if FAILMSG_RE.search(line):
                run.notes.append(f"[FAILED] message outside any test: {line.strip()}")
            continue
        if cur.result is None:
            r = RESULT_RE.match(line)
            if r:
                cur.result = r.group(1)
                if r.group(2).strip():
                    cur.after.append(r.group(2))
            else:
                cur.messages.append(line)
        elif cur.result == "FAILED" and ASSERT_RE.match(line):
            cur.asserts.append(line.strip())
        elif line.strip():
            cur.after.append(line)

    # A message printed without a trailing newline glues CUnit's result word
    # to its end ("...not removable.passed"); accept that form only as a
    # fallback, for the last message line of a test that has no result yet.
    for t in run.tests:
        while t.result is None and t.messages and not t.messages[-1].strip():
            t.messages.pop()
        if t.result is None and t.messages:
            m = re.search(r"(passed|FAILED)\s*$", t.messages[-1])
            if m:
                t.result = m.group(1)
                t.messages[-1] = t.messages[-1][: m.start()]
        for a in t.after:
            if FAILMSG_RE.search(a):
                run.notes.append(f"{t.key}: [FAILED] message after the test completed: {a.strip()}")
        if t.result == "passed" and t.logged_failure:
            msg = next(m.strip() for m in t.messages if FAILMSG_RE.search(m))
            run.notes.append(f"{t.key}: passed, but logged: {msg}")

    check_run(run)
    return run


def check_run(run: Run) -> None:
    s = run.summary
    if not {"suites", "tests", "asserts"} <= s.keys():
        run.problems.append("no CUnit 'Run Summary' (crashed, aborted, timed out or could not log in)")
        return
    s_total, s_ran, _, s_failed, s_inactive = s["suites"]
    t_total, t_ran, t_passed, t_failed, t_inactive = s["tests"]
    a_failed = s["asserts"][3]
    if int(t_total) == 0:
        run.problems.append("no test matched this pattern")
    if int(s_failed):
        run.problems.append(f"{s_failed} suite(s) failed to initialise or clean up")
    for name in run.init_failures:
        run.problems.append(f"suite {name}: initialisation/cleanup failed")
    if s_inactive not in ("0", "n/a") or t_inactive not in ("0", "n/a"):
        run.problems.append("inactive suites/tests reported")
    if int(t_ran) != int(t_total) or int(s_ran) != int(s_total):
        run.problems.append(f"only {t_ran} of {t_total} tests ran")
    if int(a_failed) and not int(t_failed):
        run.problems.append(f"{a_failed} assert(s) failed outside any failed test")
    unresolved = [t.key for t in run.tests if t.result is None]
    if unresolved:
        run.problems.append("could not find CUnit's result for: " + ", ".join(unresolved))
    n_failed = sum(1 for t in run.tests if t.result == "FAILED")
    n_passed = sum(1 for t in run.tests if t.result == "passed")
    if len(run.tests) != int(t_ran) or n_failed != int(t_failed) or n_passed != int(t_passed):
        run.problems.append(
            f"parser disagrees with CUnit summary: parsed {len(run.tests)} ran/{n_passed} passed/"
            f"{n_failed} failed, CUnit says {t_ran}/{t_passed}/{t_failed}"
        )
    if run.exit_status != 0 and n_failed == 0 and not run.problems:
        run.problems.append(f"iscsi-test-cu exited with status {run.exit_status}")


@dataclass
class Waiver:
    pattern: str
    reason: str
    partial: bool = False


def load_waivers(path: str) -> list[Waiver]:
    waivers = []
    with open(path, encoding="utf-8") as fh:
        for n, raw in enumerate(fh, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            pattern, sep, reason = line.partition("#")
            words, reason = pattern.split(), reason.strip()
            if not sep or not reason or len(words) not in (1, 2) or (len(words) == 2 and words[1] != "partial"):
                raise SystemExit(f"{path}:{n}: expected 'PATTERN [partial]  # reason', got: {line}")
            waivers.append(Waiver(words[0], reason, len(words) == 2))
    return waivers


def report(runs: list[Run], waivers: list[Waiver], out=sys.stdout, allow_unused: bool = False) -> int:
    used: set[str] = set()
    failed: list[Test] = []
    unwaived: list[Test] = []
    partial: list[Test] = []
    n = {"passed": 0, "failed": 0, "skipped": 0, "waived": 0}

    for run in runs:
        suites: dict[str, list[Test]] = {}
        for t in run.tests:
            suites.setdefault(t.suite, []).append(t)
        for suite, tests in suites.items():
            sf = [t for t in tests if t.status == "failed"]
            sk = []
            bad_skips = []
            for t in tests:
                if t.status != "skipped":
                    n[t.status] += 1
                    continue
                match = next((w for w in waivers if fnmatch.fnmatchcase(t.key, w.pattern)), None)
                if match is None:
                    bad_skips.append(t)
                    sk.append(t)
                    n["skipped"] += 1
                    continue
                used.add(match.pattern)
                if match.partial:
                    partial.append(t)
                    n["passed"] += 1
                else:
                    sk.append(t)
                    n["skipped"] += 1
                    n["waived"] += 1
            failed += sf
            unwaived += bad_skips
            ok = not sf and not bad_skips
            detail = f"{len(tests)} tests"
            if sk:
                detail += f", {len(sk)} skipped ({len(sk) - len(bad_skips)} waived)"
            if sf:
                detail += f", {len(sf)} failed: " + " ".join(t.name for t in sf)
            if bad_skips:
                detail += ", unwaived skips: " + " ".join(t.name for t in bad_skips)
            print(f"  {'PASS' if ok else 'FAIL'}  {suite:<28} {detail}", file=out)
        if run.problems:
            print(f"  FAIL  [{run.label}]", file=out)
            for p in run.problems:
                print(f"          {p}", file=out)
            if any("Run Summary" in p for p in run.problems):
                print("        last lines of its output:", file=out)
                for line in run.tail:
                    print(f"          | {line}", file=out)

    if failed:
        print("Failed tests:", file=out)
        for t in failed:
            print(f"  {t.key}", file=out)
            shown = [m.strip() for m in t.messages if FAILMSG_RE.search(m)][:3] + t.asserts[:3]
            for m in shown:
                print(f"      {m}", file=out)
    if unwaived:
        print("Skipped tests without a waiver (add to conformance/waivers.txt only with a reason):", file=out)
        for t in unwaived:
            print(f"  {t.key}: {t.skip_reason}", file=out)
    notes = [n for r in runs for n in r.notes]
    if notes:
        print("Notes (not failures; CUnit passed these):", file=out)
        for note in notes:
            print(f"  {note}", file=out)
    if partial:
        print("Passed with a part skipped (partial waivers):", file=out)
        for t in partial:
            print(f"  {t.key}: {t.skip_reason}", file=out)
    unused = [w.pattern for w in waivers if w.pattern not in used]
    problems = sum(len(r.problems) for r in runs)
    if unused and allow_unused:
        print("Note: waivers not used by this run (a subset of the tests): " + " ".join(unused), file=out)
    elif unused:
        print("Waivers no skipped test used (remove them, or fix the pattern): " + " ".join(unused), file=out)
        problems += len(unused)
    total = sum(len(r.tests) for r in runs)
    asserts = [sum(int(r.summary["asserts"][i]) for r in runs if "asserts" in r.summary) for i in (1, 3)]
    print(
        f"Summary: {total} tests: {n['passed']} passed, {n['failed']} failed, {n['skipped']} skipped "
        f"({n['waived']} waived, {len(unwaived)} not waived); asserts: {asserts[0]} run, {asserts[1]} failed; "
        f"run-level problems: {problems}",
        file=out,
    )
    # The plain closing line CI tooling understands.
    print(f"conformance: {n['passed']} passed, {n['failed'] + len(unwaived) + problems} failed, "
          f"{n['skipped']} skipped", file=out)
    return 1 if failed or unwaived or problems else 0


# --------------------------------------------------------------------------
# Self-test: every rule above must be able to fail.
# --------------------------------------------------------------------------

HEADER = "\n\n     CUnit - A unit testing framework for C - Version 2.1-3\n\n"


def summary(suites, tests, passed, failed, asserts=10, afailed=0, ran=None):
    ran = tests if ran is None else ran
    return (
        "\n\nRun Summary:    Type  Total    Ran Passed Failed Inactive\n"
        f"              suites {suites:6} {suites:6}    n/a      0        0\n"
        f"               tests {tests:6} {ran:6} {passed:6} {failed:6}        0\n"
        f"             asserts {asserts:6} {asserts:6} {asserts - afailed:6} {afailed:6}      n/a\n\n"
        "Elapsed time =    0.1 seconds\nTests completed with return value: 0\n"
    )


GOOD = (
    HEADER + "\nSuite: Inquiry\n  Test: Standard ...passed\n"
    "  Test: BlockLimits ...    [SKIPPED] Logical unit is fully provisioned. Skipping test\npassed"
    "\n  Test: EVPD ...    [WARNING] BUSY_TIMEOUT_PERIOD is undefined.\npassed" + summary(1, 3, 3, 0)
)
FAILED = (
    HEADER + "\nSuite: Read10\n  Test: Simple ...passed\n  Test: BeyondEol ...    [FAILED] READ10 "
    "successful but should have failed\nFAILED\n    1. test_read10_beyond_eol.c:38  - CU_ASSERT_EQUAL(_r,0)"
    + summary(1, 2, 1, 1, afailed=1)
)
LOGGED_ONLY = HEADER + "\nSuite: Read10\n  Test: Simple ...    [FAILED] READ10 failed\npassed" + summary(1, 1, 1, 0)
AFTER = HEADER + "\nSuite: Reserve6\n  Test: LUNReset ...passed    [FAILED] PRIN command failed\n" + summary(1, 1, 1, 0)
UNWAIVED = HEADER + "\nSuite: Verify10\n  Test: Simple ...    [SKIPPED] VERIFY10 is not implemented.\npassed" + summary(1, 1, 1, 0)
GLUED = HEADER + "\nSuite: StartStopUnit\n  Test: Simple ...    [SKIPPED] Media is not removable.passed" + summary(1, 1, 1, 0)
CRASH = HEADER + "\nSuite: Read10\n  Test: Simple ...passed\n  Test: BeyondEol ..."
NOTEST = HEADER + summary(0, 0, 0, 0, asserts=0)
INIT = HEADER + "\nSuite: Read10\nWARNING - Suite initialization failed for 'Read10'." + summary(1, 0, 0, 0, asserts=0).replace(
    "suites      1      1    n/a      0", "suites      1      1    n/a      1")
MISMATCH = HEADER + "\nSuite: Read10\n  Test: Simple ...passed" + summary(1, 2, 2, 0)


def self_test() -> int:
    waivers = [Waiver("Inquiry.BlockLimits", "fully provisioned"), Waiver("StartStopUnit.*", "not removable")]
    cases = [  # (name, text, exit status, expected verdict)
        ("clean run with waived skip", GOOD, 0, 0),
        ("CUnit FAILED test", FAILED, 1, 1),
        ("[FAILED] logged inside a passed test (probe)", LOGGED_ONLY, 0, 0),
        ("[FAILED] logged after a test", AFTER, 0, 0),
        ("skip without waiver", UNWAIVED, 0, 1),
        ("glued result word, waived skip", GLUED, 0, 0),
        ("no summary (crash)", CRASH, 139, 1),
        ("pattern matched nothing", NOTEST, 0, 1),
        ("suite init failure", INIT, 0, 1),
        ("parser/summary mismatch", MISMATCH, 0, 1),
        ("clean output but non-zero exit", GOOD, 255, 1),
    ]
    bad = 0
    checks = 0
    import io

    def judge(name, texts, want, w=waivers, allow_unused=False, expect_text=None):
        nonlocal bad, checks
        checks += 1
        buf = io.StringIO()
        got = report([parse(t, name, st) for t, st in texts], w, out=buf, allow_unused=allow_unused)
        if got != want or (expect_text and expect_text not in buf.getvalue()):
            bad += 1
            print(f"self-test FAILED: {name}: verdict {got}, expected {want}\n{buf.getvalue()}")

    for name, text, status, want in cases:
        # Cases without the glued StartStopUnit skip leave that waiver unused: allowed here,
        # judged on its own below.
        judge(name, [(text, status)], want, allow_unused=True)
    judge("a waiver no test used", [(GOOD, 0)], 1)
    judge("a waiver no test used, allowed", [(GOOD, 0)], 0, allow_unused=True)
    judge(
        "a partial waiver counts the test as passed",
        [(GOOD, 0)],
        0,
        w=[Waiver("Inquiry.BlockLimits", "one part skipped", partial=True)],
        expect_text="conformance: 3 passed, 0 failed, 0 skipped",
    )

    checks += 1
    good = parse(GOOD, "good", 0)
    if [t.status for t in good.tests] != ["passed", "skipped", "passed"]:
        bad += 1
        print(f"self-test FAILED: statuses {[t.status for t in good.tests]}")
    print(f"cunit_report self-test: {checks - bad} passed, {bad} failed")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--waivers", help="waivers file (PATTERN  # reason)")
    ap.add_argument("--self-test", action="store_true")
    ap.add_argument(
        "--allow-unused-waivers",
        action="store_true",
        help="a waiver no skipped test used is a note, not a failure (runs of a subset of the tests)",
    )
    ap.add_argument("logs", nargs="*", metavar="LOG:STATUS")
    args = ap.parse_args()
    if args.self_test:
        return self_test()
    if not args.logs or not args.waivers:
        ap.error("need --waivers and at least one LOG:STATUS")
    waivers = load_waivers(args.waivers)
    runs = []
    for spec in args.logs:
        path, _, status = spec.rpartition(":")
        with open(path, encoding="utf-8", errors="replace") as fh:
            runs.append(parse(fh.read(), os.path.basename(path), int(status)))
    return report(runs, waivers, allow_unused=args.allow_unused_waivers)


if __name__ == "__main__":
    sys.exit(main())
