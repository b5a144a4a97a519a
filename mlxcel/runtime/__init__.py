"""The host layer: the composition root that turns settings and a checkpoint into a served
model (`load`), what it hands the API (`served`), the checks a model switch makes before
touching the loaded model (`capacity`), and the model host that owns a served model's load,
unload and switch (`host`) with the one memory clean-up (`memory`). Below the API, above the
backends and the engine."""
