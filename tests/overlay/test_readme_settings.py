"""README's settings table names every switch there is, under the spelling a user sets, and no other: the overlay's
flags and variables (core/config.py) and the kernels' (sgl_kernel_sm120/settings.py)."""

from __future__ import annotations

import pathlib
import re

from sgl_kernel_sm120 import settings
from sglang_sm120.core import config

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
# Switches for tests and debug builds only, left out of the user's table on purpose.
NOT_FOR_USERS = {"library", "debug_cluster_check", "debug_probe_drop", "debug_shm_no_precheck"}


def _table() -> str:
    text = README.read_text()
    start = text.index("## Settings")
    return "\n".join(line for line in text[start:text.index("\n## ", start + 1)].splitlines() if line.startswith("|"))


def test_every_setting_is_in_the_readme_table_and_the_table_names_no_other():
    table = _table()
    named = set(re.findall(r"`((?:SGLANG|SGL)_SM120_[A-Z_]+)`", table)) | set(re.findall(r"`(--sm120-[a-z-]+)", table))
    wanted = {variable for _, variable, _ in config.ENVIRONMENT} | {flag for _, flag, *_ in config.FLAGS}
    wanted |= {settings.PREFIX + variable[len(settings.LEGACY_PREFIX):] if variable.startswith(settings.LEGACY_PREFIX)
               else variable for field, variable in settings.VARIABLES.items() if field not in NOT_FOR_USERS}
    assert named == wanted, {"missing from README": sorted(wanted - named), "unknown in README": sorted(named - wanted)}
