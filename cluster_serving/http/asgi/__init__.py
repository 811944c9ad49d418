"""What every HTTP protocol of the bridge shares: the app and its guards (body limit, bearer token,
response counting), the plain-ASGI fast path of the predict routes, the JSON error answers and
the OpenAPI document. The routes themselves are `bridge.protocol`'s."""
