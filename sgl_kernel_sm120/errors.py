"""Exceptions of the kernel package."""


class KernelsNotBuiltError(ImportError):
    """The compiled extension for the running torch (`sgl_kernel_sm120._C_torch*`) is missing or failed to load."""


class IpcAllReduceError(RuntimeError):
    """A collective step of the workspace failed on at least one rank (raised on every rank). `kind` is how a rank's
    failure crosses to its peers (exchange.agree), so that every rank raises the same type whatever its words."""

    kind = "error"


class IpcAllReduceProbeError(IpcAllReduceError):
    """The data-path probe at construction found peer pairs whose writes did not arrive (or arrived wrong), or
    whose peer loads returned wrong data, although the driver allows P2P between them. Raised on every rank;
    `pairs` lists (sender, receiver, what): data goes from sender to receiver (in a read, the receiver loads)."""

    def __init__(self, pairs: list[tuple[int, int, str]]):
        self.pairs = list(pairs)
        shown = ", ".join(f"rank {s} -> rank {r}: {what}" for s, r, what in self.pairs[:16])
        more = f" (+{len(self.pairs) - 16} more)" if len(self.pairs) > 16 else ""
        super().__init__(
            f"CUDA P2P data path probe failed for {len(self.pairs)} pair(s): {shown}{more}. The driver allows P2P "
            "between these GPUs, but the data does not arrive intact: typical causes are PCIe ACS redirection on a "
            "switch or root port, or an IOMMU in translated mode (use iommu=pt); `python -m sglang_sm120.doctor` "
            "checks both")


class IpcAllReduceHostMemoryError(IpcAllReduceError):
    """The host-memory workspace does not fit the tmpfs that holds it (a small /dev/shm: Docker and Kubernetes
    default to 64 MiB). `tmpfs` is the sentence naming the folder, its free space and the size needed."""

    kind = "host_memory"

    def __init__(self, message: str, tmpfs: str | None = None):
        super().__init__(message)
        self.tmpfs = message if tmpfs is None else tmpfs


class IpcAllReduceTimeoutError(IpcAllReduceError):
    """A spin-wait in the kernel ran past its bound: a peer never arrived. In trap mode the waiting process's CUDA
    context is gone; in exit mode the workspace is poisoned and every later call raises this again (I7, I12)."""

    def __init__(self, rank: int, peer: int, phase: str, seq: int, waited_s: float, *, context_lost: bool = True):
        self.rank, self.peer, self.phase, self.seq, self.waited_s = rank, peer, phase, seq, waited_s
        self.context_lost = context_lost
        after = ("The CUDA context of this process is no longer usable." if context_lost else "The workspace is "
                 "unusable (its later calls do nothing and raise this error); the CUDA context is not.")
        super().__init__(f"sgl_kernel_sm120 all-reduce timed out on rank {rank}: call #{seq} waited {waited_s:.2f} s "
                         f"in the {phase} phase for rank {peer}, which never arrived (a dead or desynchronised peer: "
                         f"every rank must make the same sequence of calls on a workspace). {after}")
