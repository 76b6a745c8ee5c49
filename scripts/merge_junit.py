"""Merge the junit XML files of a GPU suite run into one file (the one committed under benchmarks/results/).

    python scripts/merge_junit.py [--strict] OUT.xml [LABEL=]IN.xml ...

Every <testsuite> of the inputs goes under one <testsuites> root, whose counters are the sums; a LABEL renames
the input's suites ("sglang 0.5.23 (...)"). An input that does not exist or does not parse becomes a suite with
one error, so a stage that crashed never vanishes from the record. --strict: exit 1 when any test failed,
errored or was skipped, or a suite ran nothing (the stages where every selected test must run).
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET

COUNTERS = ("tests", "failures", "errors", "skipped")


def merge(inputs: list[str]) -> ET.Element:
    root = ET.Element("testsuites")
    for item in inputs:
        label, _, path = item.rpartition("=") if "=" in item else ("", "", item)
        try:
            top = ET.parse(path).getroot()
        except (OSError, ET.ParseError) as exc:
            suite = ET.SubElement(root, "testsuite", name=label or path, tests="1", errors="1")
            ET.SubElement(ET.SubElement(suite, "testcase", name="suite"), "error", message=f"no junit XML: {exc}")
            continue
        for suite in [top] if top.tag == "testsuite" else list(top.iter("testsuite")):
            if label:
                suite.set("name", label)
            root.append(suite)
    totals = dict.fromkeys(COUNTERS, 0)
    seconds = 0.0
    for suite in root:
        for name in COUNTERS:
            totals[name] += int(suite.get(name, 0))
        seconds += float(suite.get("time", 0.0))
    for name, value in totals.items():
        root.set(name, str(value))
    root.set("time", f"{seconds:.3f}")
    return root


def incomplete(root: ET.Element) -> int:
    """Suites with a failure, an error or a skip, or none run (what --strict refuses); each printed."""
    bad = 0
    for suite in root:
        counts = {k: int(suite.get(k, 0)) for k in COUNTERS}
        print(f">>> {suite.get('name')}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
        bad += counts["failures"] + counts["errors"] + counts["skipped"] + (counts["tests"] == 0)
    return bad


if __name__ == "__main__":
    args = sys.argv[1:]
    strict = "--strict" in args
    files = [a for a in args if a != "--strict"]
    if not files or any(a.startswith("-") for a in files):  # e.g. --help: never write a file named after it
        sys.exit(__doc__)
    out, *inputs = files
    merged = merge(inputs)
    ET.ElementTree(merged).write(out, encoding="utf-8", xml_declaration=True)
    print(out, {name: merged.get(name) for name in (*COUNTERS, "time")})
    sys.exit(1 if strict and incomplete(merged) else 0)
