"""Going on after a lost rank: the loop, checkpoint directories, buddy copies."""
