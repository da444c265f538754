"""A simulated cluster's description: its configuration and workload, its topology, its fault plan and how faults are drawn."""
