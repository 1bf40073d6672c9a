"""Models and data: model definitions and sizes, data sets and shards, the reference trainer,
devices (torch only where a module says so)."""
