"""One-letter names of the statuses, for tables of expected statuses."""

from lifecycle import KVPoll

B, W, T, S, F = (
    KVPoll.Bootstrapping,
    KVPoll.WaitingForInput,
    KVPoll.Transferring,
    KVPoll.Success,
    KVPoll.Failed,
)

__all__ = ["B", "F", "S", "T", "W"]
