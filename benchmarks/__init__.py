"""mpikv's benchmarks, kept out of the installed package (they need a clone).

Run them with ``python -m mpikv bench ...`` from a clone, or beside this file:
``python -m benchmarks ...`` from the clone's root, or ``python benchmarks/bench.py ...``.
``common`` holds what they share; ``workloads/`` the ResNet-50 and BERT-base shapes.
"""
