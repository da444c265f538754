"""The drivers of the step: collectives, the stepper a scheduler uses, step groups, the worker thread, diagnosis, pipeline stages."""
