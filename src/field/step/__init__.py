"""The field's consensus helpers run by our step: the poll functions, the queue session, the gates, pipeline parallelism, aborts."""
