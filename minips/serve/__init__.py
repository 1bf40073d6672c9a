"""The asyncio shells that drive the cores over real connections: the group server (group.py),
`minips group` (group_process.py), the global server's sessions (sessions.py) and how a session
that broke the rules ends (validation.py)."""
