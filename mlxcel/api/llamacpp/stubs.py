"""GET/POST /tools and GET/POST /cors-proxy: b10621's disabled-feature answer.

mlxcel executes no server-side tools and proxies no URLs, so these routes always answer what
b10621 answers with those features off: 403 {"error":{"message":"this feature is disabled",
"type":"feature_disabled"}}. Entry point: `FEATURE_DISABLED_HANDLERS`, a list of Litestar route
handlers to add to the app.
"""

from __future__ import annotations

import json

from litestar import Response, route

FEATURE_DISABLED_BODY = json.dumps(
    {"error": {"message": "this feature is disabled", "type": "feature_disabled"}}, separators=(",", ":")
).encode()


def feature_disabled() -> Response:
    return Response(content=FEATURE_DISABLED_BODY, status_code=403, media_type="application/json; charset=utf-8")


@route(["/tools", "/cors-proxy"], http_method=["GET", "POST"], sync_to_thread=False)
def disabled_feature() -> Response:
    return feature_disabled()


FEATURE_DISABLED_HANDLERS = [disabled_feature]
