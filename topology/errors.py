"""The one error of the topology package."""


class TopologyError(ValueError):
    """A topology that is malformed; the message says what is wrong and how to fix it."""
