"""Router mode: one server, many models, loaded on demand (b10621's --models-dir / --models-preset).

b10621 spawns a child llama-server per model and proxies to it; mlxcel keeps the children in
process. `registry` discovers the models (store cache < --models-dir < --models-preset),
`preset` reads the INI file, `pool` loads and unloads engines (LRU past --models-max) and
broadcasts their events, `download` fills the store for POST /models, `routes` answers the
router's own endpoints and `asgi` hands every other request to the named model's own app.
"""
