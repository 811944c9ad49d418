"""The embedded Flink cluster: one MiniCluster in this process's JVM that runs its jobs one after
another (the warm-up's two, the serving job, each restart's), each submitted to it over its REST
address as to any Flink cluster. PyFlink's local environment starts a MiniCluster per job and
shuts it down with the job: each start then also booted a cluster (its RPC, REST and network
threads) under the new job's first requests (docs/benchmarks.md, "One embedded cluster for every
job of a process")."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from pyflink.common.job_client import JobClient
from pyflink.java_gateway import get_gateway

log = logging.getLogger("cluster_serving.job")


class EmbeddedCluster:
    """A MiniCluster with one TaskManager of `slots` slots, configured with `settings` (Flink's
    option names), started on demand and started anew when a job needs other settings."""

    def __init__(self) -> None:
        self._cluster = None
        self._settings: dict[str, str] = {}
        self.rest_port = 0

    def serve(self, settings: dict[str, str], slots: int) -> int:
        """Runs the cluster with `settings` and `slots` (starting it, or closing a different one
        first); returns its REST port."""
        wanted = {**settings, "taskmanager.numberOfTaskSlots": str(slots)}
        if self._cluster is not None and wanted == self._settings:
            return self.rest_port
        self.close()
        jvm = get_gateway().jvm
        configuration = jvm.org.apache.flink.configuration.Configuration()
        for key, value in wanted.items():
            configuration.setString(key, value)
        minicluster = jvm.org.apache.flink.runtime.minicluster
        cluster = minicluster.MiniCluster(
            minicluster.MiniClusterConfiguration.Builder().setConfiguration(configuration)
            .setNumTaskManagers(1).setNumSlotsPerTaskManager(slots).build()
        )
        cluster.start()
        self._cluster, self._settings = cluster, wanted
        self.rest_port = cluster.getRestAddress().get().getPort()
        log.info("embedded Flink cluster up: %d task slot%s, REST on 127.0.0.1:%d", slots, "" if slots == 1 else "s", self.rest_port)
        return self.rest_port

    def job_client(self, submitted: JobClient) -> JobClient:
        """A client of a job submitted to this cluster that asks the cluster in this JVM, not its REST
        port: the client execute_async returns opens a REST client, five threads, for every call,
        and the job's status is asked every second while it serves."""
        minicluster = get_gateway().jvm.org.apache.flink.runtime.minicluster
        keep_running = getattr(minicluster, "MiniClusterJobClient$JobFinalizationBehavior").NOTHING
        loader = self._cluster.getClass().getClassLoader()
        return JobClient(minicluster.MiniClusterJobClient(submitted._j_job_client.getJobID(), self._cluster, loader, keep_running))

    def close(self) -> None:
        """Shuts the cluster down (its jobs have ended: a stop ends them first); its port is then free."""
        if self._cluster is not None:
            self._cluster.close()
            self._cluster, self._settings, self.rest_port = None, {}, 0


@contextmanager
def embedded_cluster() -> Iterator[EmbeddedCluster]:
    """An EmbeddedCluster, shut down at the exit."""
    cluster = EmbeddedCluster()
    try:
        yield cluster
    finally:
        cluster.close()
