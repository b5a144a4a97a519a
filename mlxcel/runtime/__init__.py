"""The host layer: the composition root that turns settings and a checkpoint into a served
model (`load`), what it hands the API (`served`), and the checks a model switch makes before
touching the loaded model (`capacity`). Below the API, above the backends and the engine."""
