"""The role cores: the rules of a group and of the global server, sans-IO (no asyncio, socket, time
or torch)."""
