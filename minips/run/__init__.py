"""Running minips: the command line, the one-machine launcher (`minips local`) and Ray. The top
layer: it builds each role's config and starts the roles; nothing below imports it."""
