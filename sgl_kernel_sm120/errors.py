"""Exceptions of the kernel package."""


class KernelsNotBuiltError(ImportError):
    """The compiled extension for the running torch (`sgl_kernel_sm120._C_torch*`) is missing or failed to load."""


class IpcAllReduceError(RuntimeError):
    """A collective step of the workspace failed on at least one rank (raised on every rank)."""


class IpcAllReduceTimeoutError(IpcAllReduceError):
    """A spin-wait in the kernel ran past its bound: a peer never arrived.

    The kernel records who waited for whom in host-mapped memory and traps, so the CUDA context of the
    waiting process is unusable afterwards; this error says why.
    """

    def __init__(self, rank: int, peer: int, phase: str, seq: int, waited_s: float):
        self.rank, self.peer, self.phase, self.seq, self.waited_s = rank, peer, phase, seq, waited_s
        super().__init__(
            f"sgl_kernel_sm120 all-reduce timed out on rank {rank}: call #{seq} waited {waited_s:.2f} s in the "
            f"{phase} phase for rank {peer}, which never arrived (a dead or desynchronised peer: every rank "
            f"must make the same sequence of calls on a workspace). The CUDA context of this process is no "
            f"longer usable."
        )
