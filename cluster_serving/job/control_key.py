"""The key that signs routing tables: only the job's own driver may change what is served.

A routing table travels as a control record on the request topic, which every client that sends
requests can write. The driver signs each table it writes with an HMAC-SHA256 of its text; the
job's Kafka source (cluster_serving/jvm/java/KeyValueDeserializationSchema.java) drops, counts and
logs any control record whose signature does not verify, so a forged table never reaches the
batcher. The key is `CLUSTER_SERVING_CONTROL_KEY` (64 hex digits) when set, else the file
`control.key` in the checkpoint folder, made (owner-only) at the first start. It is never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from cluster_serving.config import ConfigError

KEY_VARIABLE = "CLUSTER_SERVING_CONTROL_KEY"
KEY_FILE = "control.key"
KEY_BYTES = 32


def control_key(checkpoint_dir: Path) -> bytes:
    """The job's signing key: from the environment, else the checkpoint folder's file (made when absent)."""
    text = os.environ.get(KEY_VARIABLE)
    where = KEY_VARIABLE
    if text is None:
        path = checkpoint_dir / KEY_FILE
        where = str(path)
        if not path.exists():
            _create(path)
        text = path.read_text()
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        key = b""
    if len(key) < 16:
        raise ConfigError(f"{where}: the control key must be at least 32 hex digits")
    return key


def sign(key: bytes, table_text: str) -> str:
    """The signature header's value for a table: HMAC-SHA256 of its UTF-8 text, in hex."""
    return hmac.new(key, table_text.encode(), hashlib.sha256).hexdigest()


def _create(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # a second driver made it first
        return
    with os.fdopen(descriptor, "w") as file:
        file.write(secrets.token_hex(KEY_BYTES) + "\n")
