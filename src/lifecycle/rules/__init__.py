"""The rules of a request's lifecycle, declared once: one row per failure
reason, the transition graph with its verdicts and gates, the deadlines, a
prefill peer's health machine, the graph kernel every declared machine runs
on, the batch and reference executors, the diagrams."""
