"""What every benchmark shares: ranks and their agreement, CUDA-graph timing, NCCL's P2P mode, hardware,
norm kernels, result files (their schema is sglang_sm120/reporting/schema.py, which the report reads too)."""
