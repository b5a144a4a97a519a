"""SAE steering and monitoring: sparse autoencoders attached at decoder layers, steering
deltas carried per batch row, activation reads, and the persisted profiles and clusters."""
