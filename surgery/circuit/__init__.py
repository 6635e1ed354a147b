"""Circuits (SPEC §21): edges between a model's components, scored exactly or by attribution, and pruned.

graph.py (senders, receivers, edges), hooks.py (the passes' hooks), eap.py (EAP, EAP-IG), exact.py (edge
patching, pruned circuits), run.py (a whole study), result.py and plot.py. ``surgery.circuit(...)`` is the
entry point; docs/circuits.md explains the methods.
"""
