"""Measuring on the box which of our kernels' launches (or NCCL) is fastest at each size of a TP group, checked
exact first; the parent of a tune (processes) and its ranks (child). Importing it needs neither torch nor a GPU."""
