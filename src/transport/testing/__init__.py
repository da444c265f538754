"""What tests of the transport layer drive it with: a simulated network
(:mod:`transport.testing.simnet`) on which the connector's core runs without
a store, a socket, an engine or a thread."""
