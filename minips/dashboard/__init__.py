"""Watching a run: a live web dashboard, Prometheus /metrics and TensorBoard event files.

Read in this order: ``state.py`` (what is known of a run, from its metrics records, and tailing
a run directory live or replaying a finished one; sans-IO), ``tboard.py`` (TensorBoard event
files written by hand), ``web.py`` (the Prometheus collector, then the aiohttp routes and the
event stream), ``monitor.py`` (the task that ties them together in the global server's process
or in ``minips dashboard``). The page is ``static/index.html``.

The web part needs the ``dashboard`` extra (aiohttp, prometheus_client); the rest is stdlib.
Nothing here imports torch.
"""

__all__: list[str] = []
