"""The bridge's protocols, one module each, as KServe's model server holds them: a module reads its
protocol's requests, calls the core (`bridge.dataplane.Bridge`) and shapes its answers; the core
knows no protocol, and errors are answered by the one table in `bridge.errors`.

Each module has `register(app, bridge)`, which `bridge.http.app.PROTOCOLS` calls; its endpoints
are closures over the bridge because FastAPI reads a route's parameters from the endpoint's
signature, and the model-name parameter documents the served name, known only at run time. A
route that predicts goes through `bridge.http.fast_path.predict_route` so that it is answered
ahead of FastAPI. A protocol on another transport (gRPC) would be a sibling over the same `Bridge`, with
its own server and its own status for each of `bridge.errors`.
"""
