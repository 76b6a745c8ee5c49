"""Interim: the kernel package's switches read in one place (replaced by the kernel package's own settings module)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from .env import setting


class SettingError(ValueError):
    """A bad value of a setting; its text is one line naming the variable, the value and what is allowed."""


CACHE_ENV = "SGLANG_SM120_CACHE"
TIMEOUT_ENV, WARN_ENV, ABORT_ENV = "SGL_SM120_AR_TIMEOUT_S", "SGL_SM120_AR_WARN_S", "SGL_SM120_AR_ABORT_AFTER_S"
PDL_ENV, CLUSTERS_ENV, SHM_DIR_ENV = "SGL_SM120_AR_PDL", "SGL_SM120_FUSED_CLUSTERS", "SGL_SM120_SHM_DIR"


@dataclasses.dataclass(frozen=True)
class KernelSettings:
    timeout_s: float = 300.0
    timeout_given: bool = False
    warn_s: float = 5.0
    abort_after_s: float = 30.0
    pdl: bool = True
    fused_clusters: str = "auto"
    shm_dir: str = "/dev/shm"
    cache_dir: str = ""


def _seconds(name, default, env, zero_ok=False):
    raw = setting(name, "", env).strip()
    if raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingError(f"{name}={raw!r} is not a number of seconds") from None
    if not (value >= 0 if zero_ok else value > 0) or value != value:
        raise SettingError(f"{name}={raw!r} is out of range; allowed: seconds {'>= 0' if zero_ok else 'above 0'}")
    return value


def read(environ: Mapping[str, str] | None = None) -> KernelSettings:
    env = os.environ if environ is None else environ
    try:
        clusters = setting(CLUSTERS_ENV, "auto", env).strip().lower() or "auto"
        if clusters not in ("auto", "off"):
            raise SettingError(f"{CLUSTERS_ENV}={clusters!r} is not valid; allowed: auto, off")
        return KernelSettings(
            timeout_s=_seconds(TIMEOUT_ENV, 300.0, env), timeout_given=bool(setting(TIMEOUT_ENV, "", env).strip()),
            warn_s=_seconds(WARN_ENV, 5.0, env), abort_after_s=_seconds(ABORT_ENV, 30.0, env, zero_ok=True),
            pdl=setting(PDL_ENV, "1", env) != "0", fused_clusters=clusters,
            shm_dir=setting(SHM_DIR_ENV, "", env).strip() or "/dev/shm",
            cache_dir=setting(CACHE_ENV, "", env) or os.path.join(os.path.expanduser("~"), ".cache", "sglang_sm120"))
    except SettingError:
        raise
    except ValueError as exc:
        raise SettingError(str(exc)) from None


def launch_switches(settings: KernelSettings) -> dict:
    return {CLUSTERS_ENV: settings.fused_clusters, PDL_ENV: "1" if settings.pdl else "0"}
