"""The connector: one implementation of the transfer protocol for every engine,
its two sides, its control plane and its clocks. ``Connector`` and
``ConnectorConfig`` are importable from here as well as from their modules."""

from transport.connector.config import ConnectorConfig
from transport.connector.hub import Connector

__all__ = ["Connector", "ConnectorConfig"]
