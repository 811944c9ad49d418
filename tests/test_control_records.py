"""Only the operator changes what is served: routing tables on the request topic are taken only
when signed with the job's key (cluster_serving/job/control_key.py). An outsider who can write
requests forges tables that would remove every version and lock out later tables; nothing
changes, the forgeries are counted, and the operator's next change still applies."""

from __future__ import annotations

import time

import numpy as np
from kafka import KafkaProducer

from cluster_serving.job.control_key import KEY_FILE, sign
from cluster_serving.wire.codec import CONTROL_HEADER, SIGNATURE_HEADER
from tests.conftest import collect
from tests.onnx_models import WIDTH, scale_model
from tests.test_many_models import queues, swap_in

FAR_FUTURE = 9_999_999_999_999
# What the forger wants: scale served with no version, from a generation no later table beats.
NO_VERSIONS = f"{FAR_FUTURE}\tscale\nscale\t16\t5\t"


def send_control(config, text: str, headers: list[tuple[str, bytes]]) -> None:
    producer = KafkaProducer(bootstrap_servers=config.kafka.bootstrap_servers)
    producer.send(config.kafka.input_topic, value=text.encode(), headers=[(CONTROL_HEADER, b"table"), *headers])
    producer.flush()
    producer.close()


def served_versions(config, prefix: str, count: int) -> list[object]:
    """Sends `count` requests to scale and returns, per request, the version or the error that answered it."""
    inputs, outputs = queues(config)
    with inputs, outputs:
        for i in range(count):
            inputs.enqueue(f"{prefix}{i}", model="scale", x=np.full(WIDTH, i, np.float32))
        inputs.flush()
        results = collect(outputs, count, timeout=120)
    return [results[f"{prefix}{i}"].get("error", results[f"{prefix}{i}"].version) for i in range(count)]


def serves_version(config, version: int, prefix: str, timeout: float = 60) -> bool:
    """Whether requests sent now are served by `version`, asked until `timeout`."""
    deadline = time.monotonic() + timeout
    for attempt in range(1000):
        if served_versions(config, f"{prefix}{attempt}-", 4) == [version] * 4:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(1)
    return False


def forged_records_counted(job) -> int:
    """The job's forgedControlRecords counter, as Flink's REST API reports it (0 while absent)."""
    for vertex in job.rest(f"/jobs/{job.job_id}")["vertices"]:
        names = [metric["id"] for metric in job.rest(f"/jobs/{job.job_id}/vertices/{vertex['id']}/metrics")]
        wanted = [name for name in names if name.endswith("forgedControlRecords")]
        if wanted:
            values = job.rest(f"/jobs/{job.job_id}/vertices/{vertex['id']}/metrics?get={','.join(wanted)}")
            return sum(int(float(metric["value"])) for metric in values)
    return 0


def test_forged_tables_change_nothing_and_the_operators_next_change_applies(tmp_path, write_config, start_job) -> None:
    root = tmp_path / "models"
    scale_model(root / "scale" / "1" / "model.onnx", 2.0)
    path, config = write_config(models={"repository": str(root), "poll_interval_s": 0.5})
    job = start_job(path, config)
    assert served_versions(config, "before-", 8) == [1] * 8
    wrong_key = bytes(32)
    send_control(config, NO_VERSIONS, [])
    send_control(config, NO_VERSIONS, [(SIGNATURE_HEADER, b"0" * 64)])
    send_control(config, NO_VERSIONS, [(SIGNATURE_HEADER, sign(wrong_key, NO_VERSIONS).encode())])
    assert served_versions(config, "forged-", 50) == [1] * 50
    swap_in(root / "scale" / "2", 3.0)
    assert serves_version(config, 2, "after-")
    deadline = time.monotonic() + 30
    while forged_records_counted(job) < 3 and time.monotonic() < deadline:
        time.sleep(1)
    assert forged_records_counted(job) == 3
    log = "".join(flink_log.read_text(errors="replace") for flink_log in (path.parent / "log").glob("*.log"))
    assert "dropped a control record without a valid signature" in log
    assert sign(wrong_key, NO_VERSIONS) not in log and (config.flink.checkpoint_dir / KEY_FILE).read_text().strip() not in log


def test_a_signed_table_from_the_future_does_not_lock_out_later_tables(tmp_path, write_config, start_job) -> None:
    """As a table forged before tables were signed and kept in a checkpoint would: the operator's
    next table, of an earlier generation, still replaces it."""
    root = tmp_path / "models"
    scale_model(root / "scale" / "1" / "model.onnx", 2.0)
    path, config = write_config(models={"repository": str(root), "poll_interval_s": 0.5})
    start_job(path, config)
    key = bytes.fromhex((config.flink.checkpoint_dir / KEY_FILE).read_text())
    send_control(config, NO_VERSIONS, [(SIGNATURE_HEADER, sign(key, NO_VERSIONS).encode())])
    assert set(served_versions(config, "future-", 8)) == {"model 'scale': none of its versions opened (see the job's log)"}
    swap_in(root / "scale" / "2", 3.0)
    assert serves_version(config, 2, "after-")
