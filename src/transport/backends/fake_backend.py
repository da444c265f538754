"""Registry entry for the fake backend."""

from transport.backends.fake import FakeBootstrap, FakeManager, FakeReceiver, FakeSender

MANAGER = FakeManager
SENDER = FakeSender
RECEIVER = FakeReceiver
BOOTSTRAP = FakeBootstrap
