"""The connector: one implementation of the transfer protocol for every engine, its two sides, its control plane and its clocks."""
