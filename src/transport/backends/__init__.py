"""The transfer engines behind the registry: fake, Mooncake over TCP, NIXL over UCX."""
