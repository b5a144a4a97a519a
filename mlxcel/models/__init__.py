"""The model zoo: the family registry and the seams mlxcel owns around mlx-lm's family code."""
