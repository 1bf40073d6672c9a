"""Running minips: configuration, the command line, the one-machine launcher, Ray, run directories,
metrics and plots."""
