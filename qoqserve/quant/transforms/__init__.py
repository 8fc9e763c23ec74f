"""Function-preserving QoQ transforms (rotation, smoothing, reordering).

Each runs in place on a high-precision model before weight quantization and
leaves the model's outputs unchanged in exact arithmetic.
"""
