"""Arrays of every kind: numpy/cupy views, dtype checks, 16-bit bits, the codecs."""
