"""The few calls of torch's TCPStore the simulator's parts make, in memory."""


class Store:
    def __init__(self):
        self.d = {}

    def set(self, key, value):
        self.d[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.d[key]

    def check(self, keys):
        return all(k in self.d for k in keys)

    # the queues the fake backend's word to the other side travels on
    def queue_push(self, key, value):
        self.d.setdefault(key, []).append(value)

    def queue_len(self, key):
        return len(self.d.get(key, []))

    def queue_pop(self, key):
        return self.d[key].pop(0)

    def compare_set(self, key, expected, desired):
        """TCPStore's: ``desired`` where the key is missing and ``expected`` is
        empty, or where it holds ``expected``; the value it holds after."""
        held = self.d.get(key)
        if (held is None and expected in (b"", "")) or held == expected:
            self.d[key] = desired
        return self.d[key]
