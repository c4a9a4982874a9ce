"""The confidence gate: which (token, expert) pairs of an experts call use the delta plane.

`policies` scores pairs and turns scores into a [T, k] mask (threshold or budget), `tables`
reads and writes the per-(layer, expert) tables some scores use, `state` keeps what a step
carries to the next (the previous distribution's confidence per row, forced rows). Pure torch,
fixed shapes, no host sync: a gate runs inside a captured CUDA-graph step.
"""
