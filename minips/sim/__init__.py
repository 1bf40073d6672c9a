"""`minips simulate`: the cluster as a discrete-event simulation on the same role cores."""
