"""The pdlife simulate command: its flags, their checks, multi-node runs, the summary and comparison of runs."""
