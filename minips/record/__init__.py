"""A run's record: its directory and JSON-lines metrics, the summary and charts read back from
them, and checkpoint files. Every role writes here; the launcher and the dashboard read it. No
torch."""
