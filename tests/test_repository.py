"""The model repository as read from disk (cluster_serving/runtime/repository.py): versions and policies, servable.yaml
mistakes worded as one line, pipelines' steps, and the routing table's text."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cluster_serving.config import ConfigError, load_config
from cluster_serving.runtime.repository import RoutingTable, VersionPolicy, checked_scan, scan


def repository(root: Path, layout: dict[str, list[int]], servables: dict[str, dict] | None = None) -> Path:
    for name, versions in layout.items():
        for version in versions:
            (root / name / str(version)).mkdir(parents=True)
            (root / name / str(version) / "model.onnx").write_bytes(b"not read by a scan")
    for name, settings in (servables or {}).items():
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "servable.yaml").write_text(yaml.safe_dump(settings))
    return root


def config_for(root: Path, overrides: dict | None = None, **models):
    """A config serving `root`, with `models` as models.* keys and other `overrides` (dotted keys)."""
    return load_config(overrides={"models.repository": str(root), **{f"models.{k}": v for k, v in models.items()},
                                  **(overrides or {})})


@pytest.mark.parametrize(
    "policy, served",
    [({}, (5,)), ({"latest": 2}, (3, 5)), ({"specific": [1, 3, 9]}, (1, 3)), ("all", (1, 3, 5))],
)
def test_version_policies(policy, served) -> None:
    settings = VersionPolicy.model_validate({"all": True} if policy == "all" else policy)
    assert settings.served([3, 1, 5]) == served


def test_a_broken_newest_version_leaves_the_one_before_it_serving(tmp_path: Path) -> None:
    servable = scan(config_for(repository(tmp_path, {"m": [1, 2, 3]}))).servables["m"]
    assert servable.versions == (3,)
    assert servable.served(frozenset({("m", 3)})) == (2,)


def test_scan_reads_versions_settings_defaults_and_pipelines(tmp_path: Path) -> None:
    root = repository(
        tmp_path, {"a": [1, 2], "b": [7]},
        {"a": {"version_policy": "all", "batching": {"batch_size": 8, "run_batch_size": 2}},
         "p": {"kind": "pipeline", "steps": [{"model": "a"}, {"model": "b", "inputs": {"x": "a.y"}}]}},
    )
    (root / "a" / "notes").mkdir()  # not a version: ignored
    (root / ".hidden").mkdir()
    found = checked_scan(config_for(root, {"batching.max_delay_ms": 7}, default="b"))
    assert sorted(found.servables) == ["a", "b", "p"] and found.default == "b"
    assert found.servables["a"].versions == (1, 2)
    # batch_size and run_batch_size from servable.yaml, max_delay_ms from the config's batching
    batching = found.servables["a"].batching
    assert (batching.batch_size, batching.max_delay_ms, batching.run_batch_size) == (8, 7, 2)
    assert found.servables["b"].batching.run_batch_size == 0  # the config's default: the whole batch in one run
    assert found.servables["p"].is_pipeline and found.servables["p"].versions == (1,)


@pytest.mark.parametrize(
    "settings, problem",
    [
        ({"batching": {"batch_size": 0}}, "batching.batch_size: must be between 1 and 65536, got 0"),
        ({"bogus": 1}, "bogus: unknown key (known: batching, inputs, instances, kind, max_queue_size, outputs, postprocess, preprocess, steps, version_policy)"),
        ({"version_policy": {"latest": 1, "specific": [1]}}, "version_policy: must be one of {latest: N}, {specific: [versions]} or all"),
        ({"kind": "pipeline"}, "a pipeline lists its steps, and only a pipeline has steps"),
    ],
)
def test_a_servable_yaml_mistake_is_one_line_naming_file_and_key(tmp_path: Path, settings: dict, problem: str) -> None:
    root = repository(tmp_path, {"m": [1]}, {"m": settings})
    with pytest.raises(ConfigError) as raised:
        checked_scan(config_for(root))
    assert str(raised.value).startswith(f"models.repository: {root / 'm' / 'servable.yaml'}: ")
    assert problem in str(raised.value)


def test_a_pipeline_step_naming_nothing_is_refused(tmp_path: Path) -> None:
    root = repository(tmp_path, {"a": [1]}, {"p": {"kind": "pipeline", "steps": [{"model": "a"}, {"model": "zzz"}]}})
    with pytest.raises(ConfigError, match="step 'zzz': no model 'zzz' in the repository"):
        checked_scan(config_for(root))


def test_starting_needs_a_default_that_exists(tmp_path: Path) -> None:
    root = repository(tmp_path, {"a": [1], "b": [1]})
    with pytest.raises(ConfigError, match="models.default: no model 'model'; the repository serves a, b"):
        checked_scan(config_for(root))


def test_the_routing_table_text_round_trips_and_leaves_out_failed_versions(tmp_path: Path) -> None:
    found = scan(config_for(repository(tmp_path, {"a": [1, 2], "b": [3]}, {"a": {"version_policy": "all"}}), default="a"))
    table = RoutingTable.of(found, left_out=frozenset({("a", 2)}), generation=42)
    assert table.text() == "42\ta\na\t32\t0\t1\nb\t32\t0\t3"
    assert RoutingTable.parse(table.text()) == table
    assert table.same_serving(RoutingTable.of(found, left_out=frozenset({("a", 2)})))
    assert not table.same_serving(RoutingTable.of(found))
