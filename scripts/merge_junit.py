"""Merge the junit XML files of a GPU suite run into one file (the one committed under benchmarks/results/).

    python scripts/merge_junit.py OUT.xml IN1.xml IN2.xml ...

Every <testsuite> of the inputs goes under one <testsuites> root, whose counters are the sums; an input that
does not exist or does not parse is an error (a stage that crashed must not vanish from the record).
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET

COUNTERS = ("tests", "failures", "errors", "skipped")


def merge(paths: list[str]) -> ET.Element:
    root = ET.Element("testsuites")
    totals = dict.fromkeys(COUNTERS, 0)
    seconds = 0.0
    for path in paths:
        tree = ET.parse(path)
        top = tree.getroot()
        suites = [top] if top.tag == "testsuite" else list(top.iter("testsuite"))
        for suite in suites:
            root.append(suite)
            for name in COUNTERS:
                totals[name] += int(suite.get(name, 0))
            seconds += float(suite.get("time", 0.0))
    for name, value in totals.items():
        root.set(name, str(value))
    root.set("time", f"{seconds:.3f}")
    return root


if __name__ == "__main__":
    out, *inputs = sys.argv[1:]
    merged = merge(inputs)
    ET.ElementTree(merged).write(out, encoding="utf-8", xml_declaration=True)
    print(out, {name: merged.get(name) for name in (*COUNTERS, "time")})
