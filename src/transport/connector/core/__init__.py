"""The connector's core, without I/O: the requests of one rank and their
protocol (:mod:`~transport.connector.core.machine`), each side's part of it,
the clocks, and the messages and events it takes and the effects it asks
for. Nothing here reads a clock, a socket, the store or an engine, or starts
a thread: :class:`~transport.connector.hub.Connector` drives it."""
