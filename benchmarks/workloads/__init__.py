"""What the benchmarks measure: the verify forward's op list and model shapes, and what --via-sglang needs of SGLang."""
