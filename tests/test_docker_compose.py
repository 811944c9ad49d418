"""docker-compose.yml and docker/, checked without Docker: the machines we build on have no Docker
engine, so a wrong path, port, image tag or command would otherwise only show on a user's machine."""

from __future__ import annotations

import importlib.util
import re
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path, PurePosixPath
from types import ModuleType

import pytest
import yaml

from cluster_serving import jvm
from cluster_serving.config import load_config
from cluster_serving.ops.cli import parser as cli_parser
from cluster_serving.ops.local_broker import SINGLE_NODE_SETTINGS

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, dict] = COMPOSE["services"]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
FLINK_DOCKERFILE = ROOT / "docker" / "flink" / "Dockerfile"
BROKER_POM = jvm.BROKER_POM
# Where docker/flink/Dockerfile puts the repository inside the image.
IN_IMAGE = PurePosixPath("/opt/cluster-serving")
CONFIG_IN_IMAGE = IN_IMAGE / "docker" / "config.yaml"


def repo_path(image_path: str | PurePosixPath) -> Path:
    """The repository file that an /opt/cluster-serving/... path in the image was copied from."""
    return ROOT / PurePosixPath(image_path).relative_to(IN_IMAGE)


def dockerfiles() -> list[tuple[Path, Path]]:
    """(build context, Dockerfile) of every service that is built."""
    builds = {(svc["build"]["context"], svc["build"]["dockerfile"]) for svc in SERVICES.values() if "build" in svc}
    return [(ROOT / context, ROOT / context / dockerfile) for context, dockerfile in sorted(builds)]


def instructions(dockerfile: Path) -> list[tuple[str, list[str]]]:
    """(INSTRUCTION, arguments) per Dockerfile instruction, continuation lines joined."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [(line.split()[0].upper(), line.split()[1:]) for line in lines if line and not line.startswith("#")]


def load_submit_script() -> ModuleType:
    """docker/submit.py is a script, not a package module."""
    spec = importlib.util.spec_from_file_location("docker_submit", ROOT / "docker" / "submit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_deployment_has_its_services() -> None:
    assert {"kafka", "jobmanager", "taskmanager", "submit", "bridge"} <= set(SERVICES)
    assert SERVICES["jobmanager"]["command"] == "jobmanager"
    assert SERVICES["taskmanager"]["command"] == "taskmanager"


def test_build_contexts_and_dockerfiles_exist() -> None:
    assert dockerfiles(), "no service is built"
    for context, dockerfile in dockerfiles():
        assert context.is_dir(), context
        assert dockerfile.is_file(), dockerfile


def test_every_copied_or_mounted_repository_path_exists() -> None:
    for context, dockerfile in dockerfiles():
        for instruction, args in instructions(dockerfile):
            if instruction in ("COPY", "ADD") and not any(arg.startswith("--from=") for arg in args):
                sources = [arg for arg in args if not arg.startswith("--")][:-1]
                assert sources, f"{instruction} {args}"
                for source in sources:
                    assert (context / source).exists(), f"{dockerfile.name}: {instruction} {source}"
    for name, service in SERVICES.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith((".", "/")):
                assert (ROOT / source).exists(), f"{name}: {volume}"
            else:
                assert source in COMPOSE["volumes"], f"{name}: undeclared volume {source}"


def test_host_ports_are_bound_to_loopback_only() -> None:
    published = [port for service in SERVICES.values() for port in service.get("ports", [])]
    assert len(published) >= 3
    for port in published:
        assert isinstance(port, str) and port.startswith("127.0.0.1:") and port.count(":") == 2, port


def test_kafka_advertises_a_reachable_address_per_listener() -> None:
    """Containers get kafka:9092 (the config's bootstrap); host clients the published port."""
    env = SERVICES["kafka"]["environment"]
    advertised = dict(item.split("://") for item in env["KAFKA_ADVERTISED_LISTENERS"].split(","))
    assert advertised["PLAINTEXT"] == load_config(ROOT / "docker" / "config.yaml").kafka.bootstrap_servers
    host_port = advertised["HOST"].rsplit(":", 1)[1]
    assert f"127.0.0.1:{host_port}:{host_port}" in SERVICES["kafka"]["ports"]


def image_references() -> list[str]:
    """Images pulled by compose or named by FROM / COPY --from= in a Dockerfile (not stage names)."""
    images = [svc["image"] for svc in SERVICES.values() if "build" not in svc]
    for _, dockerfile in dockerfiles():
        steps = instructions(dockerfile)
        stages = {args[2].lower() for instruction, args in steps if instruction == "FROM" and len(args) == 3}
        for instruction, args in steps:
            if instruction == "FROM":
                images.append(args[0])
            images += [arg.split("=", 1)[1] for arg in args if arg.startswith("--from=")]
        images = [image for image in images if image.lower() not in stages]
    return images


def pinned_flink_version() -> str:
    """The apache-flink version that pyproject.toml pins."""
    pins = [dep for dep in PYPROJECT["project"]["dependencies"] if dep.replace(" ", "").startswith("apache-flink==")]
    assert len(pins) == 1, pins
    return pins[0].split("==", 1)[1].strip()


def local_broker_kafka_version() -> str:
    """<kafka.version> of the local development broker's POM."""
    root = ET.parse(BROKER_POM).getroot()
    namespace = {"m": "http://maven.apache.org/POM/4.0.0"}
    version = root.find("m:properties/m:kafka.version", namespace)
    assert version is not None and version.text, f"no <kafka.version> in {BROKER_POM}"
    return version.text.strip()


def test_images_are_pinned_and_flink_matches_pyflink() -> None:
    images = image_references()
    for image in images:
        name, _, tag = image.rpartition(":")
        assert name and tag and tag != "latest" and "/" not in tag, f"unpinned image {image}"
    flink_tags = {image.split(":")[1] for image in images if image.startswith("flink:")}
    assert flink_tags == {f"{pinned_flink_version()}-scala_2.12-java17"}
    # The built image is tagged with the Flink version it runs.
    built = {svc["image"] for svc in SERVICES.values() if "build" in svc}
    assert built == {f"cluster-serving-flink:{pinned_flink_version()}"}


def test_kafka_image_is_the_local_brokers_version() -> None:
    """Compose runs the Kafka release that cluster_serving.jvm fetches for the local broker."""
    kafka_tags = {image.split(":")[1] for image in image_references() if image.startswith("apache/kafka:")}
    assert kafka_tags == {local_broker_kafka_version()}
    assert SERVICES["kafka"]["image"] == f"apache/kafka:{local_broker_kafka_version()}"


def test_kafka_single_node_settings_match_the_local_broker() -> None:
    """One node: every internal topic (offsets, transactions, share-group state) has one replica and
    a min ISR of 1, and messages as large as the local broker takes get through."""
    env = SERVICES["kafka"]["environment"]
    keys = [key for key in SINGLE_NODE_SETTINGS if key.endswith((".replication.factor", ".min.isr", "max.bytes"))]
    assert "share.coordinator.state.topic.replication.factor" in keys
    for key in keys:
        name = "KAFKA_" + key.upper().replace(".", "_")
        assert name in env, f"docker-compose.yml: kafka lacks {name} (cluster_serving/ops/local_broker.py sets {key})"
        assert str(env[name]) == SINGLE_NODE_SETTINGS[key], name


def test_the_image_fetches_and_compiles_against_the_connector_of_the_jvm_room() -> None:
    """Same connector artifact and jar names as cluster_serving.jvm, from Maven Central (no wheel)."""
    steps = instructions(FLINK_DOCKERFILE)
    args = dict(arg.split("=", 1) for instruction, values in steps if instruction == "ARG" for arg in values)
    assert args.get("KAFKA_CONNECTOR") == jvm.CONNECTOR
    runs = [" ".join(values) for instruction, values in steps if instruction == "RUN"]
    fetch = [run for run in runs if "dependency:copy" in run]
    assert len(fetch) == 1, fetch
    assert '-Dartifact="${KAFKA_CONNECTOR}"' in fetch[0] and "-Dmdep.stripVersion=true" in fetch[0]
    # stripVersion: the jar is named <artifactId>.jar, which must be the prebuilt jar cluster_serving.jvm names.
    assert f"{jvm.CONNECTOR.split(':')[1]}.jar" == jvm.CONNECTOR_JAR
    javac = [run for run in runs if "javac" in run]
    assert len(javac) == 1, javac
    classpath = re.search(r'-cp "([^"]+)"', javac[0]).group(1).split(":")
    assert classpath == ["/flink-lib/*", f"jars/{jvm.CONNECTOR_JAR}"]
    assert f"jars/{jvm.HELPER_JAR}" in " ".join(runs)
    environment = dict(value.split("=", 1) for instruction, values in steps if instruction == "ENV" for value in values)
    copied = [values[-1].rstrip("/") for instruction, values in steps if instruction == "COPY" and "--from=jars" in values]
    assert copied == [environment[jvm.PREBUILT_ENV]], "the image's jars are not where cluster_serving.jvm is told to look"
    text = FLINK_DOCKERFILE.read_text().lower()
    for stale in ("shigawire", "pip3 download", "flink-connector-kafka.jar", "kafka-clients.jar"):
        assert stale not in text, f"docker/flink/Dockerfile still mentions {stale}"


def test_the_image_python_satisfies_requires_python() -> None:
    venv = re.search(r"python3\.(\d+) -m venv ", FLINK_DOCKERFILE.read_text())
    assert venv, "docker/flink/Dockerfile creates no venv with a versioned python3.X"
    minimum = re.fullmatch(r">=\s*3\.(\d+)", PYPROJECT["project"]["requires-python"].strip())
    assert minimum and int(venv.group(1)) >= int(minimum.group(1))


def test_services_run_as_the_flink_user() -> None:
    """Flink 2.2's image no longer steps down from root in its entrypoint: the image's last USER
    is what every service runs as."""
    users = [values[0] for instruction, values in instructions(FLINK_DOCKERFILE) if instruction == "USER"]
    assert users and users[-1] == "flink"


def test_flink_properties_name_the_jobmanager_and_the_image_venv() -> None:
    properties = dict(
        line.replace(" ", "").split(":", 1)
        for line in SERVICES["jobmanager"]["environment"]["FLINK_PROPERTIES"].splitlines()
        if line.strip()
    )
    assert properties["jobmanager.rpc.address"] == "jobmanager"
    dockerfile = ROOT / "docker" / "flink" / "Dockerfile"
    venv = PurePosixPath(properties["python.executable"]).parent.parent
    assert f"-m venv {venv}" in dockerfile.read_text()
    assert properties["python.client.executable"] == properties["python.executable"]


def test_bridge_command_is_the_cli_http_subcommand() -> None:
    command = SERVICES["bridge"]["command"]
    assert command[0] in PYPROJECT["project"]["scripts"]
    args = cli_parser().parse_args(command[1:])  # exits (fails the test) on an unknown subcommand
    assert args.command == "http"
    assert PurePosixPath(args.config) == CONFIG_IN_IMAGE


def test_submit_runs_the_job_script_with_the_compose_config() -> None:
    command = SERVICES["submit"]["command"]
    assert command[0] == "python" and repo_path(command[1]).is_file()
    submit = load_submit_script()
    args = submit.parse_args(command[2:])
    assert PurePosixPath(args.config) == CONFIG_IN_IMAGE
    flink_run = submit.flink_run_command(Path(args.config), "http://jobmanager:8081")
    assert flink_run[:5] == ["flink", "run", "-m", "jobmanager:8081", "--detached"]
    assert Path(flink_run[flink_run.index("-py") + 1]) == ROOT / "cluster_serving" / "job" / "main.py"
    assert flink_run[-2:] == ["--config", str(CONFIG_IN_IMAGE)]


@pytest.mark.parametrize("name", ["submit.py", "config.yaml"])
def test_the_image_carries_what_the_commands_name(name: str) -> None:
    dockerfile = ROOT / "docker" / "flink" / "Dockerfile"
    copies = [args for instruction, args in instructions(dockerfile) if instruction == "COPY"]
    destination = str(IN_IMAGE / "docker")
    assert any(f"docker/{name}" in args[:-1] and args[-1].rstrip("/") == destination for args in copies)


def test_compose_config_loads_and_points_inside_the_deployment() -> None:
    config = load_config(ROOT / "docker" / "config.yaml")  # no file checks: paths are in-container
    assert config.kafka.bootstrap_servers == "kafka:9092"
    assert config.http.host == "0.0.0.0"
    assert config.http.flink_rest_url == "http://jobmanager:8081"
    assert config.flink.jars == ()  # the image's prebuilt connector ($CLUSTER_SERVING_JARS)
    # The model and the checkpoints live in the volume that every service using them mounts.
    for name in ("submit", "taskmanager", "bridge"):
        assert f"serving:{config.model.path.parent}" in SERVICES[name]["volumes"], name
    for name in ("submit", "jobmanager", "taskmanager"):
        assert f"serving:{config.flink.checkpoint_dir.parent}" in SERVICES[name]["volumes"], name
