"""`python -m sglang_sm120.report`: one markdown file (JSON attached) about this box to paste into an issue:
the environment, the doctor's output, the routing tables the tuner measured, and any benchmark results named.

    python -m sglang_sm120.report                          # writes ./sglang_sm120_report.md (--out elsewhere)
    python -m sglang_sm120.report --results benchmarks/results --out r.md

Offline and without torch: the doctor, which needs torch and the GPUs, runs as its own process (--no-doctor
skips it, --doctor-output FILE uses a saved run). The host name is replaced by "<host>" where it is a word of its
own. Every result document this repository writes is taken (reporting/document.py RESULT_KINDS); the files named
that are not one are listed at the end of the report and on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from .reporting import document
from .routing import cache

DEFAULT_OUT = "sglang_sm120_report.md"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang_sm120.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"markdown file to write (default ./{DEFAULT_OUT}; '-': "
                                                           "stdout)")
    parser.add_argument("--results", nargs="*", default=[], metavar="PATH",
                        help="result files or folders to include (benchmarks/results: bench_allreduce, bench_verify, "
                             "bench_transports, bench_polling, trap delivery, tune tables)")
    parser.add_argument("--tables", nargs="*", default=None, metavar="FILE",
                        help=f"routing tables to include (default: every one in ${cache.CACHE_ENV}, "
                             "default ~/.cache/sglang_sm120)")
    parser.add_argument("--no-doctor", action="store_true", help="do not run the doctor")
    parser.add_argument("--doctor-output", metavar="FILE", help="include this saved doctor output instead of a run")
    parser.add_argument("--doctor-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)

    env = document.environment()
    if args.no_doctor:
        doctor = None
    elif args.doctor_output:
        with open(args.doctor_output, encoding="utf-8") as handle:
            doctor = {"command": f"(saved output: {args.doctor_output})", "exit_code": None, "output": handle.read()}
    else:
        print("running python -m sglang_sm120.doctor ...", file=sys.stderr, flush=True)
        doctor = document.run_doctor(timeout_s=args.doctor_timeout)
    tables = ([cache.load_file(path) for path in args.tables] if args.tables is not None
              else cache.find_tables())
    results = document.read_results(args.results)
    report = document.build(env=env, doctor=doctor, tables=tables, results=results)
    text = document.redact_host(document.markdown(report, tables=tables, results=results))
    for entry in results:
        if "doc" not in entry:
            print(f"skipped {entry['path']}: {entry.get('error')}", file=sys.stderr)
    if args.out == "-":
        sys.stdout.write(text)
    else:
        path = os.path.abspath(args.out)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
        size = len(text)
        note = "" if size <= document.ISSUE_LIMIT_CHARS else (
            f"; longer than an issue takes ({document.ISSUE_LIMIT_CHARS} characters): attach the file instead")
        where = " (--out FILE writes it elsewhere)" if args.out == DEFAULT_OUT else ""
        print(f"wrote the report to {path}{where}: {size} characters{note}; please send it with your issue")
    return 0


if __name__ == "__main__":
    sys.exit(main())
