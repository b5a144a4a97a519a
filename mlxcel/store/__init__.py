"""The model store: where checkpoints live, how `-m` references resolve, conversion."""
