"""The HTTP bridge (server.py assembles it). READY_LINE lives here, apart from the server's
imports, so that what starts a bridge and waits for this line (ops.children) loads none of them."""

READY_LINE = "http bridge listening on "
