"""What every benchmark shares: ranks and their agreement, CUDA-graph timing, NCCL's P2P mode, hardware,
norm kernels, result files and their schema (schema.py)."""
