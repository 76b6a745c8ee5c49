"""Measuring on the box: which of our kernels' configurations (and NCCL) is fastest at each message size of a TP
group, checked exact before it is timed, timed inside CUDA graphs as the slowest rank, agreed on every rank
(tuner); the eligible candidates (candidates); the exactness check (verify); the timing (timing); the child
processes the measurements run in (launch, child); the P2P fingerprints the doctor prints (fabric).
torch and the GPU are touched only inside functions: importing this package needs neither."""
