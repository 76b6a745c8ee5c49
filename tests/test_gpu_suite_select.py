"""scripts/gpu_suite.sh's TEST_SELECT on CPU: it narrows every pytest stage, ANDed with the stage's own -k, so a
long stage can be split over device calls (a stage cut by its bound leaves no junit XML)."""

from __future__ import annotations

import os
import re
import subprocess

SUITE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "gpu_suite.sh")


def kexpr(base: str | None, select: str | None) -> str:
    with open(SUITE) as f:
        function = re.search(r"^kexpr\(\) \{.*?^\}$", f.read(), re.S | re.M).group(0)
    env = {k: v for k, v in os.environ.items() if k != "TEST_SELECT"}
    if select is not None:
        env["TEST_SELECT"] = select
    call = "kexpr" if base is None else f'kexpr "{base}"'
    done = subprocess.run(["bash", "-c", f"{function}\nprintf '[%s]' \"$({call})\""], capture_output=True, text=True,
                          env=env, check=True)
    return done.stdout


def test_the_stage_selection_and_test_select_combine():
    assert kexpr(None, None) == "[]"  # pytest: an empty -k selects everything
    assert kexpr("not oversubscribed", None) == "[not oversubscribed]"
    assert kexpr(None, "late_peer or probe") == "[late_peer or probe]"
    assert kexpr("not oversubscribed", "late_peer or probe") == "[(not oversubscribed) and (late_peer or probe)]"


def test_every_pytest_stage_goes_through_kexpr():
    with open(SUITE) as f:
        text = f.read()
    commands = re.findall(r"-m pytest -m gpu[^;]*?(?:;;|--junitxml)", text, re.S)
    assert len(commands) >= 9, commands
    for command in commands:
        assert '-k "$(kexpr' in command, command
