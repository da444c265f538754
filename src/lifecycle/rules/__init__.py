"""The rules of a request's lifecycle, declared once: the transition graph, its batch and reference executors, its diagrams."""
