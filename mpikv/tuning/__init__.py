"""The table that picks each bucket's reduction strategy, and the timings it is made from."""
