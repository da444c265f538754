"""What the connector's engine-contract tests share (the unit tests that read the
code, the integration tests that run a driver): which of the connector's members
are its own, who overrides them, and an object that is not an engine."""

from transport.connector.hub import Connector


def _own(name):
    """A name the connector holds that is its own business: one leading underscore."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


CONNECTOR_OWN = {n for n in dir(Connector) if _own(n)}


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def overrides(cls):
    """Every ``Class.name`` between ``cls`` and Connector that redefines one of
    the connector's own members."""
    out = []
    for klass in cls.__mro__:
        if klass is Connector:
            break
        out += [f"{klass.__qualname__}.{n}" for n in vars(klass) if n in CONNECTOR_OWN]
    return out


class Partial:
    NOTIFIES = "yes"

    def start(self, regions, host):
        return {}

    def write(self, info, src, dst, lens, note):
        return 1
