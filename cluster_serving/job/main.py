"""The serving job: Kafka requests -> micro-batch -> decode -> ONNX Runtime -> encode -> Kafka results.

Run embedded (a Flink MiniCluster in this process, web UI on 127.0.0.1:<flink.rest_port>):
    python -m cluster_serving.job.main --config cluster_serving.config/config.yaml
Or submit to a running Flink cluster:
    flink run -py cluster_serving/job/main.py -pyexec .venv/bin/python -- --config /abs/path/config.yaml
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

from py4j.java_gateway import JavaObject
from pyflink.common import Configuration, WatermarkStrategy
from pyflink.common.job_client import JobClient
from pyflink.datastream import MapFunction, StreamExecutionEnvironment
from pyflink.datastream.connectors.kafka import KafkaSource
from pyflink.java_gateway import get_gateway

if __package__ in (None, ""):  # `flink run -py cluster_serving/job/main.py` runs this file as a plain script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cluster_serving.config import JOB_NAME, RESTART_SIGNAL, ConfigError, ServingConfig, load_config  # noqa: E402
from cluster_serving.config.command_line import config_parser  # noqa: E402
from cluster_serving.job.batch import FRAME, REQUEST_ROW, micro_batches, name_python_stages, split_results  # noqa: E402
from cluster_serving.job.control_key import control_key  # noqa: E402
from cluster_serving.job.embedded_cluster import EmbeddedCluster, embedded_cluster  # noqa: E402
from cluster_serving.job.kafka_io import RESULT_RECORD, drop_committer_gauge_warning, request_source, result_sink  # noqa: E402
from cluster_serving.job.operators import DecodeBatch, EncodeResults, ServeBatch  # noqa: E402
from cluster_serving.job.recovery import latest_checkpoint, prune_other_runs  # noqa: E402
from cluster_serving.job.repository_watch import RepositoryWatch, send_table  # noqa: E402
from cluster_serving.job.warm_up import LIMIT_S as WARM_UP_LIMIT_S  # noqa: E402
from cluster_serving.job.warm_up import STALLED_S as WARM_UP_STALLED_S  # noqa: E402
from cluster_serving.job.warm_up import TOPIC_CONFIGS as WARM_UP_TOPIC_CONFIGS  # noqa: E402
from cluster_serving.job.warm_up import (  # noqa: E402
    results_awaited, second_job_requests, skip_earlier_requests, warm_up_bursts, warm_up_config, warm_up_topic_settings,
    write_requests, zeros_request,
)
from cluster_serving.jvm import find_java, pipeline_jars  # noqa: E402
from cluster_serving.kafka.admin import ensure_topics  # noqa: E402
from cluster_serving.net.ports import port_taken  # noqa: E402
from cluster_serving.runtime.model import ModelError  # noqa: E402
from cluster_serving.runtime.repository import Repository, RoutingTable, checked_scan  # noqa: E402
from cluster_serving.runtime.servables import repository_check  # noqa: E402

log = logging.getLogger("cluster_serving.job")

# A compiler directive that leaves every method C2 has not compiled by then to C1 (c2_done).
C2_DONE = '[{match: "*.*", c2: {Exclude: true}}]'


def configure_logging() -> None:
    """INFO for our lifecycle lines, WARNING for chatty libraries. Called again once the Flink
    environment exists, because starting PyFlink's gateway lowers the root logger to WARNING."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(logging.INFO)
    for noisy in ("kafka", "apache_beam"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def submitted_by_flink_cli() -> bool:
    """True under `flink run -py`: the CLI starts this file with its Java gateway's port set."""
    return "PYFLINK_GATEWAY_PORT" in os.environ


def cluster_settings(config: ServingConfig) -> dict[str, str]:
    """The embedded cluster's addresses: REST on flink.rest_port, everything on 127.0.0.1."""
    return {
        "rest.port": str(config.flink.rest_port),
        "rest.address": "127.0.0.1",
        "rest.bind-address": "127.0.0.1",
        "jobmanager.bind-host": "127.0.0.1",
        "taskmanager.bind-host": "127.0.0.1",
        "taskmanager.host": "127.0.0.1",
    }


def flink_configuration(config: ServingConfig, resume_from: Path | None, cluster_port: int = 0) -> Configuration:
    """Job settings, plus where the job goes: to the embedded cluster's REST port `cluster_port`,
    else (a replay) to a MiniCluster of its own with the embedded cluster's addresses. Under
    `flink run` these are stacked over the cluster's config: rest.* would redirect the CLI's
    submission to flink.rest_port, so they are left to the cluster."""
    flink = config.flink
    settings = {
        # Kept after a stop or a crash, so that the next start resumes from them (cluster_serving/job/recovery.py).
        "execution.checkpointing.dir": flink.checkpoint_dir.as_uri(),
        "execution.checkpointing.externalized-checkpoint-retention": "RETAIN_ON_CANCELLATION",
        "restart-strategy.type": "fixed-delay",
        "restart-strategy.fixed-delay.attempts": str(flink.restart_attempts),
        "restart-strategy.fixed-delay.delay": f"{flink.restart_delay_ms} ms",
        # Python UDFs run inside the JVM (pemja): faster than a separate worker process.
        "python.execution-mode": "thread",
        "python.executable": sys.executable,
        "python.client.executable": sys.executable,
        # In thread mode a bundle's end does nothing, but the operator still checks for it on a
        # timer every bundle.time ms, each check a mail that wakes the task thread: once a minute.
        "python.fn-execution.bundle.size": "1000",
        "python.fn-execution.bundle.time": "60000",
        # Records cross a network exchange when a buffer fills or this timeout passes (Flink's
        # default 100 ms): a short one keeps a trickle of requests from waiting for full buffers.
        "execution.buffer-timeout.interval": "5 ms",
        # Chained operators hand records on without a serializer copy; none of ours changes a
        # record it was given, and the source makes a new Row per Kafka record.
        "pipeline.object-reuse": "true",
    }
    if cluster_port:
        settings.update({"execution.target": "remote", "execution.attached": "true", "rest.address": "127.0.0.1",
                         "rest.port": str(cluster_port)})
    elif not submitted_by_flink_cli():
        settings.update(cluster_settings(config))
    if resume_from is not None:
        settings["execution.state-recovery.path"] = resume_from.as_uri()
    conf = Configuration()
    for key, value in settings.items():
        conf.set_string(key, value)
    return conf


# Builds the inference stage from the config: a parameter of the job so that a test can run the
# same pipeline with a stage of its own (tests/failing_job.py) instead of a switch in this one.
InferStage = Callable[[ServingConfig], MapFunction]


def infer_stage(config: ServingConfig) -> MapFunction:
    return ServeBatch(config)


def build_pipeline(
    env: StreamExecutionEnvironment, config: ServingConfig, table: RoutingTable, source: KafkaSource,
    infer: InferStage = infer_stage,
) -> None:
    """Wires the stages from `source` (kafka_io's request_source, or a replay's); each stage is one
    module of this package. The operators' short names are what the Flink web UI shows as the
    job's graph and in its metrics' names (`0.infer.cluster_serving.batchSize`); their
    descriptions, shown with them, say more."""
    kafka = config.kafka
    requests = env.from_source(
        source, WatermarkStrategy.no_watermarks(), "kafka-requests", REQUEST_ROW
    ).set_description(f"Kafka topic {kafka.input_topic}, group {kafka.group_id}")
    batches = micro_batches(requests, table.text(), config.limits.max_instance_bytes).uid("micro-batch-jvm").set_description(
        "in the JVM: a batch per model and version, at its batch_size requests, max_delay_ms after its first,"
        " or (max_delay_ms 0) once the input has nothing more ready"
    )
    frames = (
        batches.map(DecodeBatch(config.limits)).name("decode").uid("decode")
        .map(infer(config)).name("infer").uid("infer")
        .map(EncodeResults(kafka), output_type=FRAME).name("encode").uid("encode")
    )
    results = split_results(frames, RESULT_RECORD).name("split-results").uid("split-results")
    dead_letters = f", dead letters to {kafka.dead_letters}" if kafka.dead_letters else ""
    results.sink_to(result_sink(kafka)).name("kafka-results").uid("kafka-results").set_description(
        f"Kafka topic {kafka.result_topic}{dead_letters}, {kafka.delivery.replace('_', ' ')}"
    )
    name_python_stages(env, "decode", "infer", f"in Python: decode -> ONNX Runtime ({table.describe()}) -> encode")
    drop_committer_gauge_warning()


def preflight(config: ServingConfig, own_rest_port: int = 0) -> Repository:
    """Fails fast, with one line, on what would otherwise surface as a Java stack trace later: the
    embedded cluster's Java and REST port (a taken port was a 50-line BindException after the
    MiniCluster had started), the models (each version opened once), then the broker (a short TCP
    probe first, see ensure_topics). Returns the repository to serve. `own_rest_port`: the port
    this process's embedded cluster holds already (a restart's)."""
    config.check_files()
    pipeline_jars(config.flink)
    repository = checked_scan(config)
    if not submitted_by_flink_cli():
        find_java()
        port = config.flink.rest_port
        if port and port != own_rest_port and port_taken("127.0.0.1", port):
            raise ConfigError(
                f"flink.rest_port: 127.0.0.1:{port} is in use; stop what listens there "
                "(`cluster-serving status` shows a running instance) or set another flink.rest_port"
            )
    else:
        if config.flink.jvm_options:
            log.warning("flink.jvm_options are for the embedded cluster: under `flink run`, set the cluster's env.java.opts")
        if config.flink.warm_up_requests:
            log.warning("flink.warm_up_requests is for the embedded cluster: a Flink cluster's TaskManagers outlive its jobs")
    repository_check(config, repository)
    ensure_topics(config.kafka)
    return repository


def prepare_process_environment(config: ServingConfig) -> str:
    """Environment variables PyFlink reads when it launches the embedded Flink JVM; returns the
    folder of Flink's own log."""
    # Thread mode embeds the Python found first on PATH into the JVM: it must be this venv's,
    # or the task fails with "No module named 'pemja'" and restarts forever.
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    # PyFlink starts a gRPC "loopback" worker pool on all interfaces ([::]) for local jobs, used
    # only by process mode. Thread mode never calls it; this (PyFlink's own switch) skips it.
    os.environ["_python_worker_execution_mode"] = "process"
    # The jars go on the embedded JVM's class path (PyFlink appends HADOOP_CLASSPATH to it) rather
    # than with each job: a job's own class loader makes new classes of them, which the JIT compiles
    # anew, and a job restarted in this JVM (run) would start on cold code.
    jars = os.pathsep.join(str(jar) for jar in pipeline_jars(config.flink))
    if not submitted_by_flink_cli() and jars not in os.environ.get("HADOOP_CLASSPATH", ""):
        os.environ["HADOOP_CLASSPATH"] = os.pathsep.join(filter(None, [os.environ.get("HADOOP_CLASSPATH"), jars]))
    # PyFlink starts the embedded cluster's JVM with JVM_ARGS (Flink's scripts' variable); ours follow the caller's.
    if config.flink.jvm_options:
        os.environ["JVM_ARGS"] = " ".join([os.environ.get("JVM_ARGS", ""), *config.flink.jvm_options]).strip()
    # Flink's own log (JobManager, TaskManager, Kafka clients) goes next to the config file, not
    # into the venv; an explicit FLINK_LOG_DIR wins.
    return os.environ.setdefault("FLINK_LOG_DIR", str(config.flink_log_dir))


def resume_point(config: ServingConfig, fresh: bool) -> Path | None:
    """The retained checkpoint to restore, or None to start from the group's committed offsets."""
    checkpoint_dir = config.flink.checkpoint_dir
    checkpoint = None if fresh else latest_checkpoint(config.flink)
    if checkpoint is None:
        log.info(
            "%s: starting from the committed offsets of group %s (else the earliest); checkpoints go to %s",
            "--fresh" if fresh else "no retained checkpoint", config.kafka.group_id, checkpoint_dir,
        )
        return None
    kind = "savepoint" if checkpoint.parent == config.flink.savepoint_dir else "checkpoint"
    log.info("resuming from the retained %s %s", kind, checkpoint)
    prune_other_runs(config.flink, keep=checkpoint)
    return checkpoint


def create_environment(config: ServingConfig, resume_from: Path | None, checkpoints: bool = True,
                       cluster: EmbeddedCluster | None = None) -> StreamExecutionEnvironment:
    """The environment of a job on `cluster` (started with this config's settings if it runs with
    others), else on `flink run`'s cluster or a MiniCluster of its own."""
    log_dir = prepare_process_environment(config)
    if cluster is not None:
        port = cluster.serve(cluster_settings(config), config.flink.parallelism)
        java_environment = get_gateway().jvm.org.apache.flink.streaming.api.environment.StreamExecutionEnvironment
        env = StreamExecutionEnvironment(java_environment(flink_configuration(config, resume_from, port)._j_configuration))
    else:
        env = StreamExecutionEnvironment.get_execution_environment(flink_configuration(config, resume_from))
    configure_logging()
    log.info("Flink log folder: %s", log_dir)
    if submitted_by_flink_cli():  # embedded, they are on the JVM's class path (prepare_process_environment)
        env.add_jars(*(jar.as_uri() for jar in pipeline_jars(config.flink)))
    env.set_parallelism(config.flink.parallelism)
    if checkpoints:
        env.enable_checkpointing(config.flink.checkpoint_interval_ms)
    return env


def effective_configuration(env: StreamExecutionEnvironment) -> JavaObject:
    """The configuration the job is submitted with: under `flink run` the cluster's config.yaml and
    the CLI's options (-m, --detached) below ours. PyFlink has no public getter for it."""
    return env._j_stream_execution_environment.getConfiguration()


def attached(env: StreamExecutionEnvironment) -> bool:
    """False under `flink run --detached`: like Java's execute(), return once the job is submitted
    instead of waiting for its end. The embedded MiniCluster is always attached."""
    options = get_gateway().jvm.org.apache.flink.configuration.DeploymentOptions
    return bool(effective_configuration(env).get(options.ATTACHED))


def web_ui(env: StreamExecutionEnvironment) -> str:
    """The REST address the job was submitted to: the embedded one, or the cluster's."""
    rest = get_gateway().jvm.org.apache.flink.configuration.RestOptions
    settings = effective_configuration(env)
    return f"http://{settings.get(rest.ADDRESS) or 'localhost'}:{settings.get(rest.PORT)}"


def submit(config: ServingConfig, repository: Repository, fresh: bool, infer: InferStage,
           cluster: EmbeddedCluster | None) -> tuple[JobClient, RepositoryWatch, bool]:
    """Builds and submits the job; returns its client, the watch of what it was told to serve, and
    whether this process stays attached to it (under `flink run --detached` it does not)."""
    table = RoutingTable.of(repository)
    key = control_key(config.flink.checkpoint_dir)
    env = create_environment(config, resume_point(config, fresh), cluster=cluster)
    build_pipeline(env, config, table, request_source(config.kafka, key), infer)
    client = env.execute_async(JOB_NAME)
    client = cluster.job_client(client) if cluster else client
    log.info("job %s submitted; Flink web UI: %s", client.get_job_id(), web_ui(env))
    log.info(
        "reading %s, writing %s on %s",
        config.kafka.input_topic, config.kafka.result_topic, config.kafka.bootstrap_servers,
    )
    log.info("serving %s; requests naming no model go to %s", table.describe(), table.default)
    # A job restored from a checkpoint keeps the table it checkpointed for the requests it reads
    # again; this record, after them in the log, switches it to the repository as it is now.
    send_table(config, table, key)
    return client, RepositoryWatch(config, repository, table, key), attached(env)


class Signals:
    """What signals asked of this process: to stop (SIGINT, SIGTERM) or to restart its job
    (RESTART_SIGNAL); a stop wins. A handler only records the signal: interrupting a py4j call
    mid-flight would log a traceback, and a threading.Event set from a handler can deadlock on its
    own lock, where SimpleQueue.put is reentrant."""

    def __init__(self) -> None:
        self.stop = self.restart = False
        self._received: queue.SimpleQueue[int] = queue.SimpleQueue()
        for signum in (signal.SIGINT, signal.SIGTERM, RESTART_SIGNAL):
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, _frame: object) -> None:
        if signum == RESTART_SIGNAL:
            self.restart = True
        else:
            self.stop = True
        self._received.put(signum)

    @property
    def asked(self) -> bool:
        return self.stop or self.restart

    def wait(self, timeout: float) -> bool:
        """Whether a signal has asked for something, now or within `timeout` seconds."""
        if not self.asked:
            with contextlib.suppress(queue.Empty):
                self._received.get(timeout=timeout)
        return self.asked

    def clear(self) -> None:
        self.restart = False


def run(config: ServingConfig, repository: Repository, fresh: bool = False, infer: InferStage = infer_stage) -> int:
    """Submits the job and, unless detached, serves until Ctrl-C/SIGTERM (then stops it with a
    final savepoint) or until the job ends by itself, polling the model repository meanwhile;
    returns the exit code. RESTART_SIGNAL stops the job with a final savepoint and submits it
    again from there, as the config file reads now, in this process: the new job runs in the
    same JVM, on the code its JIT compiled for the last (docs/operations.md). Embedded, every job
    runs on one EmbeddedCluster, shut down as this returns."""
    if submitted_by_flink_cli():
        return serve_jobs(config, repository, fresh, infer, None)
    with embedded_cluster() as cluster:
        return serve_jobs(config, repository, fresh, infer, cluster)


def serve_jobs(config: ServingConfig, repository: Repository, fresh: bool, infer: InferStage,
               cluster: EmbeddedCluster | None) -> int:
    """run() on `cluster` (None: on `flink run`'s), after a warm-up there if the config asks for one."""
    signals = Signals()  # from here on, a stop asked while the job starts is a clean stop once it runs
    if config.flink.warm_up_requests and cluster is not None:
        warm_up(config, repository, infer, signals, cluster)
        if signals.stop:
            return 0
    client, watch, stays = submit(config, repository, fresh, infer, cluster)
    if not stays:
        return 0
    while True:
        if not serve_until_asked(client, config, watch, signals):
            return 1
        stop_with_savepoint(client, config.flink.savepoint_dir)
        if signals.stop:
            return 0
        signals.clear()
        log.info("restarting the job in this JVM with %s", config.source or "the default config")
        config = load_config(config.source)
        repository = preflight(config, own_rest_port=cluster.rest_port if cluster else 0)
        client, watch, _ = submit(config, repository, False, infer, cluster)


def warm_up(config: ServingConfig, repository: Repository, infer: InferStage, signals: Signals, cluster: EmbeddedCluster) -> None:
    """Serves flink.warm_up_requests requests of zeros through the same pipeline on topics of their
    own (job/warm_up.py) in two jobs, one after the other: the first in bursts, the second a short
    backlog as it starts, then paced. The serving job then starts in a JVM whose JIT has compiled
    its per-request path and has met a job's start twice: after a single warm-up job, it compiled
    the path again under the serving job's first requests; with flink.jit_after_warm_up c1, C1
    then compiles what C2 has not (c2_done). A warm-up that fails is logged; serving goes on. A
    stop asked during the bursts ends it once the burst in flight is answered, without the second
    job."""
    count = config.flink.warm_up_requests
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cluster-serving-warm-up-") as folder:
        warm = warm_up_config(config, Path(folder))
        table, key = RoutingTable.of(repository), control_key(Path(folder))
        request, answered, deadline, capacity = zeros_request(repository), 0, started + WARM_UP_LIMIT_S, 0.0
        bursts, tail = warm_up_bursts(request, count), []
        try:
            ensure_topics(warm.kafka, topic_configs=WARM_UP_TOPIC_CONFIGS, per_topic=warm_up_topic_settings(config))
            log.info("warming up: %d requests of zeros through the job on %s, then more in a second job", bursts[-1].stop,
                     warm.kafka.input_topic)
            with results_awaited(warm) as awaited:
                with warm_up_job(warm, table, key, infer, cluster) as submit:
                    for number, burst in enumerate(bursts):
                        written = time.monotonic()
                        send_table(warm, table, key)
                        write_requests(warm, request, burst, transaction=number % 2 == 1)
                        submit()
                        answered += awaited(len(burst), deadline)
                        if time.monotonic() > deadline or signals.stop:
                            break
                    else:  # every burst answered: the second job's rates are fractions of the last one's
                        capacity = len(bursts[-1]) / (time.monotonic() - written)
                if capacity:
                    backlog, tail = second_job_requests(bursts[-1].stop, capacity)
                    with warm_up_job(warm, table, key, infer, cluster) as submit:
                        send_table(warm, table, key)
                        write_requests(warm, request, backlog)
                        submit()
                        answered += awaited(len(backlog), time.monotonic() + WARM_UP_STALLED_S)
                        for numbers, rate in tail:
                            write_requests(warm, request, numbers, rate)
                        answered += awaited(tail[-1][0].stop - backlog.stop, time.monotonic() + WARM_UP_STALLED_S)
        except Exception as exc:  # py4j and Kafka errors alike: the job serves unwarmed
            log.warning("warm-up failed (%s); serving without it", java_reason(exc))
            return
    rates = ", ".join(f"{rate:,.0f}" for _, rate in tail)
    log.info("warmed up: %d of %d requests answered in %.1f s%s", answered, (tail[-1][0] if tail else bursts[-1]).stop,
             time.monotonic() - started, f" (the last paced at {rates} req/s)" if tail else "")
    if config.flink.jit_after_warm_up == "c1":
        c2_done()


@contextlib.contextmanager
def warm_up_job(warm: ServingConfig, table: RoutingTable, key: bytes, infer: InferStage,
                cluster: EmbeddedCluster) -> Iterator[Callable[[], None]]:
    """A warm-up job on the warm-up topics, past the requests on them by now; what it yields submits
    the job (once the requests it should meet as a backlog are written). At the exit the job stops
    with a savepoint once the JIT's compilers are quiet; on an error it is cancelled."""
    skip_earlier_requests(warm)
    env = create_environment(warm, None, cluster=cluster)
    build_pipeline(env, warm, table, request_source(warm.kafka, key), infer)
    clients: list[JobClient] = []

    def submit() -> None:
        clients[:] = clients or [cluster.job_client(env.execute_async(f"{JOB_NAME} warm-up"))]

    try:
        yield submit
        await_quiet_compilers()
        final_savepoint(clients[0], warm.flink.checkpoint_dir)
    except BaseException:
        if clients and not clients[0].get_job_status().result().is_globally_terminal_state():
            clients[0].cancel().result()
        raise


def await_quiet_compilers(timeout_s: float = 10.0, busy_ms: int = 50, every_s: float = 0.5) -> None:
    """Waits (up to `timeout_s`) until the JVM's JIT compilers spend less than `busy_ms` of each
    `every_s`: what they queued under the warm-up's load is then compiled."""
    compilation = get_gateway().jvm.java.lang.management.ManagementFactory.getCompilationMXBean()
    deadline, spent = time.monotonic() + timeout_s, compilation.getTotalCompilationTime()
    while time.monotonic() < deadline:
        time.sleep(every_s)
        spent, before = compilation.getTotalCompilationTime(), spent
        if spent - before < busy_ms:
            return


def c2_done() -> None:
    """Adds a compiler directive to the JVM (as `jcmd <pid> Compiler.directives_add` would) that
    leaves whatever runs hot from now on to C1 (flink.jit_after_warm_up: c1); a JVM that takes no
    directives is a warning."""
    with tempfile.TemporaryDirectory(prefix="cluster-serving-jit-") as folder:
        path = Path(folder) / "c2-done.json"
        path.write_text(C2_DONE)
        try:
            answer = get_gateway().jvm.clusterserving.flink.CompilerDirectives.add(str(path))
        except Exception as exc:  # py4j's errors: another JVM, without HotSpot's diagnostic commands
            answer = java_reason(exc)
    if "1 compiler directives added" in str(answer):
        log.info("the JIT compiles with C1 only from now on (flink.jit_after_warm_up: c1)")
    else:
        log.warning("the JIT took no directive (%s); C2 goes on compiling", str(answer).strip())


def serve_until_asked(client: JobClient, config: ServingConfig, watch: RepositoryWatch, signals: Signals) -> bool:
    """Polls the job and the model repository until a signal asks for something (True) or the
    job ends by itself (False)."""
    polled = time.monotonic()
    while not signals.wait(1.0):
        status = client.get_job_status().result()
        if status.is_globally_terminal_state():
            log.error("job %s ended: %s (see the Flink log)", client.get_job_id(), status.name)
            return False
        if config.models.poll_interval_s and time.monotonic() - polled >= config.models.poll_interval_s:
            watch.poll()
            polled = time.monotonic()
    return True


def stop_with_savepoint(client: JobClient, folder: Path, retry_s: float = 15.0) -> None:
    """Stops the job the way Flink stops cleanly: a final savepoint, after which the sink has
    flushed every result and the next start resumes exactly there. A job whose tasks are still
    starting cannot take one yet, so it is tried again for `retry_s`; then the job is cancelled."""
    log.info("stopping job %s with a final savepoint", client.get_job_id())
    deadline = time.monotonic() + retry_s
    while True:
        try:
            path = final_savepoint(client, folder)
            break
        except Exception as exc:  # py4j wraps Flink's reasons in its own error types
            if time.monotonic() < deadline and not client.get_job_status().result().is_globally_terminal_state():
                time.sleep(0.5)
                continue
            log.warning("no final savepoint (%s); cancelling the job", java_reason(exc))
            client.cancel().result()
            return
    log.info("final savepoint %s; the next start resumes from it", path)


def java_reason(exc: Exception) -> str:
    """The innermost cause of a py4j error's Java trace (Flink's own words), else its first line."""
    lines = str(exc).splitlines() or [type(exc).__name__]
    causes = [line.removeprefix("Caused by: ") for line in lines if line.startswith("Caused by: ")]
    return causes[-1] if causes else lines[0]


def final_savepoint(client: JobClient, folder: Path) -> str:
    """Stops the job with a savepoint in `folder`; returns its path."""
    # PyFlink's JobClient.stop_with_savepoint (still in 2.2.1) calls a Java signature Flink 2 no longer has
    # (it needs the savepoint format), so the Java client is called directly.
    format_type = get_gateway().jvm.org.apache.flink.core.execution.SavepointFormatType.CANONICAL
    return client._j_job_client.stopWithSavepoint(False, folder.as_uri(), format_type).get()


def main(argv: list[str] | None = None, infer: InferStage = infer_stage) -> int:
    parser = config_parser("python -m cluster_serving.job.main", __doc__.splitlines()[0])
    parser.add_argument("--fresh", action="store_true", help="ignore retained checkpoints")
    args = parser.parse_args(argv)
    configure_logging()
    # Until run() handles it, a restart asked for during the start-up checks is dropped (its default would end this process).
    signal.signal(RESTART_SIGNAL, signal.SIG_IGN)

    def serve() -> int:
        config = load_config(args.config)
        return run(config, preflight(config), args.fresh, infer)

    return exit_code(serve)


class JobFailed(Exception):
    """A job that ended in failure; its cause is in the Flink log."""


def exit_code(work: Callable[[], int], verbose: bool = False) -> int:
    """Runs a command's work: a mistake a user can make is one `error:` line and exit code 2 (and
    its traceback when `verbose`). Ctrl-C, or `cluster-serving start` stopping its children, during
    the start-up checks (from run() on, signals are a clean stop once the job runs), is 130:
    nothing to undo."""
    try:
        return work()
    except (ConfigError, ModelError, JobFailed) as exc:
        if verbose:
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
