"""`python -m sglang_sm120.launch_server ...`: `python -m sglang.launch_server` with the overlay active.

With sglang-sm120 installed this is the same as SGLang's launcher (the entry point activates the overlay
in every process). From a source checkout without an install, the entry point is not registered, and the
spawned scheduler processes would come up unpatched; this alias then registers it for the run, through a
throw-away dist-info directory on sys.path (which spawned processes inherit) and PYTHONPATH.
"""

from __future__ import annotations

import atexit
import os
import runpy
import shutil
import sys
import tempfile
from importlib.metadata import entry_points

PLUGIN_GROUP = "sglang.srt.plugins"
PLUGIN_NAME = "sm120_allreduce"
PLUGIN_VALUE = "sglang_sm120.plugin:activate"


def entry_point_registered() -> bool:
    return any(ep.value == PLUGIN_VALUE for ep in entry_points(group=PLUGIN_GROUP))


def register_entry_point_for_this_run() -> str:
    root = tempfile.mkdtemp(prefix="sglang_sm120_ep_")
    atexit.register(shutil.rmtree, root, True)
    dist_info = os.path.join(root, "sglang_sm120_checkout-0.0.0.dist-info")
    os.makedirs(dist_info)
    with open(os.path.join(dist_info, "METADATA"), "w") as handle:
        handle.write("Metadata-Version: 2.1\nName: sglang-sm120-checkout\nVersion: 0.0.0\n")
    with open(os.path.join(dist_info, "entry_points.txt"), "w") as handle:
        handle.write(f"[{PLUGIN_GROUP}]\n{PLUGIN_NAME} = {PLUGIN_VALUE}\n")
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    extra = [root, package_parent]
    sys.path.extend(p for p in extra if p not in sys.path)
    previous = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(extra + ([previous] if previous else []))
    return root


def main() -> None:
    if not entry_point_registered():
        register_entry_point_for_this_run()
    from . import activate

    activate()
    # SGLang's launcher as __main__: it loads plugins (ours again: idempotent), parses sys.argv, serves.
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
