"""The asyncio shells that drive the cores over real connections: group server, `minips group`, the
global server's sessions and checkpoints."""
