"""The benchmarks: the step against the all-reduce floor, transfers, and the engines' memory."""
