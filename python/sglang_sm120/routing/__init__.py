"""The routing table: the only thing `python -m sglang_sm120.tune` writes and the runtime reads. Which route (NCCL, or
one of our kernels' configurations) serves each message size, the measurements that chose it, and the key of the
box it was measured on (table); where it is kept and how a stale or broken one is recognised (cache). Free of
SGLang and torch."""
