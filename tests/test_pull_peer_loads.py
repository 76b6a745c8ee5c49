"""The pull transport's peer loads, read from the built library's SASS (CPU; runs in CI).

A pull consumer loads a pack from every peer's pull area (csrc/transports/pull.cuh P7). On PCIe these loads only
overlap when each writes registers of its own and nothing uses a loaded value before the last load of the pack's
batch is issued; otherwise each load waits for the one before it, a round trip each (7 per pack at 8 ranks). The
source can read as if they overlap while the machine code serialises them (placing each load's value as it returns
did), so this reads the SASS of every pull kernel, for sm_120a and sm_90a (`cuobjdump -sass`, which runs `nvdisasm`).

In a pull kernel every `LDG.E.128.STRONG.SYS` is a load from a pull area (the kernels' own inputs are plain loads, the
flags 64-bit ones). A run is a sequence of them that ends at the first instruction that reads or overwrites a register
one of its loads wrote (a load that writes such a register shares it). The sources of a pack are loaded in batches
of B (the kernel's batch, below): each batch's loads, at least B - 1 of them, must be one run.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
import re
import shutil
import subprocess

from tests.test_build import ARCHS, REPO_ROOT, _built_library, _cuobjdump, _missing, _nvcc

PEER_LOAD = "LDG.E.128.STRONG.SYS"
INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
REGISTER = re.compile(r"(?<![A-Za-z0-9_])R(\d+)\b")
KERNEL = re.compile(r"([a-z_]+_kernel)I(13__nv_bfloat16|6__half)((?:L[ib]\d+E)+)E")
# The kernel families that can run the pull transport (the one-shot ones take it as a template argument).
ONESHOT = ("oneshot_all_reduce_kernel", "oneshot_add_rmsnorm_kernel", "oneshot_add_rmsnorm_cluster_kernel",
           "oneshot_add_rmsnorm_grouped_kernel")
HIER = ("hier_pull_all_reduce_kernel", "hier_pull_add_rmsnorm_kernel")


@functools.lru_cache(maxsize=None)
def _source_constant(path: str, name: str) -> int:
    text = open(os.path.join(REPO_ROOT, "csrc", path)).read()
    return int(re.search(rf"\b{name}\s*=\s*(\d+)", text).group(1))


def _pull_transport() -> int:
    return _source_constant("ar_types.h", "kTransportPull")


@dataclasses.dataclass(frozen=True)
class PullKernel:
    family: str
    dtype: str
    args: tuple[int, ...]
    world: int  # the sources of one pack: ranks (one-shot) or island positions (hierarchical)
    batch: int
    sum_sites: int  # hierarchical: places whose loads are island sums (the rest are results and partials)

    @property
    def label(self) -> str:
        return f"{self.family}<{', '.join([self.dtype, *map(str, self.args)])}>"


def _pull_kernel(mangled: str) -> PullKernel | None:
    """The pull kernel `mangled` names, with its batch as ar_kernels.cu chooses it; None for other kernels."""
    m = KERNEL.search(mangled)
    if not m:
        return None
    family, dtype = m.group(1), m.group(2).lstrip("0123456789")
    args = tuple(int(x) for x in re.findall(r"L[ib](\d+)E", m.group(3)))
    pull = _pull_transport()
    if family in HIER:
        island = args[0]
        packs = args[1] if family == "hier_pull_add_rmsnorm_kernel" else 1
        unroll = packs if packs <= _source_constant("ar_kernels.cu", "kHeldPacks") else 1  # for_each_row_pack
        # island_part is called twice (with and without islands), inside the pack loop
        return PullKernel(family, dtype, args, island, island, 2 * unroll)
    if family not in ONESHOT:
        return None
    world = args[0]
    if family == "oneshot_add_rmsnorm_kernel":
        packs, transport = args[1], args[2]
        batch = world if packs != 1 or world <= 4 else 4  # the 64-register kernel waits in two batches at 8
    else:
        transport = args[-1]
        batch = min(world, 4) if family == "oneshot_add_rmsnorm_grouped_kernel" else world
    return PullKernel(family, dtype, args, world, batch, 0) if transport == pull else None


def _registers(operand: str) -> set[int]:
    out = set()
    for m in REGISTER.finditer(operand):
        first = int(m.group(1))
        out |= set(range(first, first + (2 if operand[m.end():].startswith(".64") else 1)))
    return out


@dataclasses.dataclass
class Run:
    loads: list[str] = dataclasses.field(default_factory=list)
    ended_by: str = "the end of the kernel"


def peer_load_runs(instructions: list[str]) -> list[Run]:
    """The kernel's peer loads split into runs (module docstring). Registers of a 128-bit load are 4-aligned and
    wider operands 2- or 4-aligned, so an operand overlaps a load's registers exactly when its first one is among
    them."""
    runs, run, live = [], None, {}
    for text in instructions:
        body = text.split(None, 1)[1] if text.startswith("@") else text
        opcode, _, rest = body.partition(" ")
        operands = [o.strip() for o in rest.split(",")] if rest else []
        writes_first = bool(operands) and not opcode.startswith(("ST", "RED", "ATOM")) and bool(
            REGISTER.match(operands[0].lstrip("-|~!")))
        written = _registers(operands[0]) if writes_first else set()
        read = set().union(*(_registers(o) for o in operands[1 if writes_first else 0:]))
        if opcode == PEER_LOAD:
            written = set(range(min(written), min(written) + 4))
        if run is not None:
            clash = (read | written) & set(live)
            if clash:
                reg = min(clash)
                how = "writes" if reg in written and opcode == PEER_LOAD else ("reads" if reg in read else "overwrites")
                run.ended_by = f"`{text}`, which {how} R{reg} loaded by `{live[reg]}`"
                runs.append(run)
                run, live = None, {}
        if opcode == PEER_LOAD:
            if run is None:
                run = Run()
            run.loads.append(text)
            live.update(dict.fromkeys(written, text))
    if run is not None:
        runs.append(run)
    return runs


def _kernel_instructions(sass: str):
    """(mangled name, instruction texts) of every function in `cuobjdump -sass` output."""
    name, body = None, []
    for line in sass.splitlines():
        if m := re.search(r"Function : (\S+)", line):
            if name:
                yield name, body
            name, body = m.group(1), []
        elif name and (m := INSTRUCTION.match(line)):
            body.append(m.group(1))
    if name:
        yield name, body


def _wheel_file(dist_name: str, name: str, folder: str) -> str | None:
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name == name and "/".join(f.parent.parts).endswith(folder):
            return str(dist.locate_file(f))
    return None


@functools.lru_cache(maxsize=1)
def _nvdisasm_dir() -> str | None:
    """cuobjdump -sass runs nvdisasm: from the `nvidia-cuda-nvdisasm` wheel, the toolkit, the copy that torch's
    triton ships (in every stack's venv) or PATH, the first found."""
    nvcc = _nvcc()
    candidates = [_wheel_file("nvidia-cuda-nvdisasm", "nvdisasm", "bin"),
                  os.path.join(os.path.dirname(nvcc), "nvdisasm") if nvcc else None,
                  _wheel_file("triton", "nvdisasm", "backends/nvidia/bin"), shutil.which("nvdisasm")]
    for path in candidates:
        if path and os.path.isfile(path):
            if not os.access(path, os.X_OK):
                os.chmod(path, 0o755)
            return os.path.dirname(path)
    return None


def _sass(path: str, arch: str) -> str:
    tool = _cuobjdump()
    if tool is None:
        _missing("cuobjdump not found: install the pinned `nvidia-cuda-cuobjdump` package")
    disasm = _nvdisasm_dir()
    if disasm is None:
        _missing("nvdisasm not found (cuobjdump -sass needs it): install `nvidia-cuda-nvdisasm` or triton")
    env = dict(os.environ, PATH=disasm + os.pathsep + os.environ.get("PATH", ""))
    out = subprocess.run([tool, "-sass", "-arch", arch, path], capture_output=True, text=True, env=env)
    assert out.returncode == 0, f"cuobjdump -sass -arch {arch} {path} failed:\n{out.stdout[-2000:]}\n{out.stderr}"
    return out.stdout


def test_pull_peer_loads_of_a_pack_are_all_in_flight_before_any_is_used():
    path = _built_library()
    for arch in ARCHS:
        checked, failures = set(), []
        for mangled, instructions in _kernel_instructions(_sass(path, arch)):
            kernel = _pull_kernel(mangled)
            if kernel is None or kernel.batch < 3:  # fewer than 2 peer loads a batch: nothing to overlap
                continue
            checked.add((kernel.family, kernel.world))
            runs = peer_load_runs(instructions)
            full = [r for r in runs if len(r.loads) >= kernel.batch - 1]
            lengths = [len(r.loads) for r in runs]
            if kernel.sum_sites:
                # The hierarchical kernels also load one result pack per pack and two partial planes per island:
                # runs of their own, not sums. Each place that sums an island's packs must still be one full run.
                bad = len(full) < kernel.sum_sites
                expected = f"{kernel.sum_sites} runs of >= {kernel.batch - 1} loads"
            else:
                bad = not full or len(full) < len(runs)
                expected = f"every run >= {kernel.batch - 1} loads"
            if bad:
                short = next((r for r in runs if len(r.loads) < kernel.batch - 1), None)
                why = f"; the first short run ends at {short.ended_by}" if short else ""
                failures.append(f"{arch} {kernel.label}: peer-load runs {lengths}, expected {expected}{why}")
        for family in ONESHOT + HIER:
            assert (family, 8) in checked, f"{arch}: no pull kernel {family} at 8 ranks found in {path}"
        assert not failures, "pull kernels whose peer loads of one pack wait for each other:\n" + "\n".join(failures)


def test_runs_end_at_a_use_or_at_a_shared_register():
    """The splitting itself, on SASS shaped like the serialised and the overlapped code."""
    in_flight = ["LDG.E.128.STRONG.SYS R4, desc[UR4][R4.64]", "LDG.E.128.STRONG.SYS R8, desc[UR4][R8.64]",
                 "@!P0 LDG.E.128.STRONG.SYS R12, desc[UR4][R2.64+0x10]", "MOV R20, R9",
                 "LDG.E.128.STRONG.SYS R4, desc[UR4][R6.64]"]
    assert [len(r.loads) for r in peer_load_runs(in_flight)] == [3, 1]
    assert "reads R9" in peer_load_runs(in_flight)[0].ended_by
    shared = ["LDG.E.128.STRONG.SYS R32, desc[UR4][R32.64]", "IADD.64 R34, R30, R16",
              "LDG.E.128.STRONG.SYS R40, desc[UR4][R40.64]", "LDG.E.128.STRONG.SYS R40, desc[UR4][R36.64]"]
    runs = peer_load_runs(shared)
    assert [len(r.loads) for r in runs] == [1, 1, 1]
    assert "overwrites R34" in runs[0].ended_by and "writes R40" in runs[1].ended_by
    address = ["LDG.E.128.STRONG.SYS R4, desc[UR4][R2.64]", "LDG.E.128.STRONG.SYS R8, desc[UR4][R6.64]"]
    assert [len(r.loads) for r in peer_load_runs(address)] == [1, 1]  # the second address is the first's value
