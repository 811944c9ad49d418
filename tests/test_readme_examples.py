"""Every Python and curl example in README.md and the docs pages (in the site's order), run as
written against a running stack: a local broker, an embedded job and the HTTP bridge. A user copies these blocks; one that stopped working
(an undefined name, a missing file, a placeholder, a promise the code no longer keeps) fails here.

Blocks are found by their fence: ```python blocks, and ```bash or ```sh blocks that start with
`curl`. An HTML comment on the lines just before a fence says more about the block:
- `<!-- model: FILE -->`: it runs against a job serving FILE, which an earlier block wrote into the
  working folder (the sample model of `cluster-serving init` otherwise);
- `<!-- repository: DIR -->` (with `<!-- default-model: NAME -->`): it runs against a job serving
  the model repository DIR, which an earlier block wrote into the working folder;
- `<!-- expect-error: MESSAGE -->`: it shows a refusal, so it must print or raise MESSAGE (a curl
  command: answer another status than 200, with MESSAGE in its error).
The README's addresses (the default broker, topics and bridge of cluster_serving/config/config.yaml) are replaced by
the test stack's own before a block runs; Python blocks run in this process, each in a fresh
namespace, all in one working folder, in README order.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import subprocess
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster_serving.client import InputQueue, OutputQueue
from cluster_serving.config import defaults, load_config
from cluster_serving.ops.children import EmbeddedJob, HttpBridge, LocalBroker
from cluster_serving.ops.processes import write_run_config
from tests.paths import PROJECT_ROOT

README = PROJECT_ROOT / "README.md"
# The docs pages in the order of the site's navigation: a page's blocks may use files an earlier one wrote.
PAGES = [README, *(PROJECT_ROOT / "docs" / next(iter(entry.values())) for entry in yaml.safe_load((PROJECT_ROOT / "mkdocs.yml").read_text())["nav"])]
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<language>\w*)\s*$")
MARK = re.compile(r"^\s*<!--\s*(?P<key>[\w-]+)(?::\s*(?P<value>.*?))?\s*-->\s*$")
CURL_TIMEOUT_S = 60


@dataclass(frozen=True)
class Block:
    """One fenced code block of the README."""

    language: str
    code: str
    line: int  # of the opening fence, 1-based
    marks: dict[str, str] = field(default_factory=dict)
    page: str = "README.md"

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runnable(self) -> bool:
        return self.language == "python" or (self.language in ("bash", "sh") and self.code.lstrip().startswith("curl"))


def readme_blocks(text: str, page: str = "README.md") -> list[Block]:
    """The fenced blocks of a markdown text, indented ones (inside list items) included, each with
    the marks of the comment lines right above its fence."""
    lines, blocks, at = text.splitlines(), [], 0
    while at < len(lines):
        opening = FENCE.match(lines[at])
        if not opening:
            at += 1
            continue
        indent, end = opening["indent"], at + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        code = "\n".join(line[len(indent):] for line in lines[at + 1:end]) + "\n"
        blocks.append(Block(opening["language"], code, at + 1, _marks(lines, at), page))
        at = end + 1
    return blocks


def _marks(lines: list[str], fence: int) -> dict[str, str]:
    marks, above = {}, fence - 1
    while above >= 0 and (mark := MARK.match(lines[above])):
        marks[mark["key"]] = mark["value"] or ""
        above -= 1
    return marks


BLOCKS = [
    block for path in PAGES for block in readme_blocks(path.read_text(), str(path.relative_to(PROJECT_ROOT))) if block.runnable
]


@dataclass(frozen=True)
class Stack:
    """Where a job serving one model and its bridge listen: the README's addresses, rewritten."""

    bootstrap: str
    input_topic: str
    result_topic: str
    url: str

    def rewrite(self, code: str) -> str:
        readme = defaults()
        replacements = {
            readme.kafka.bootstrap_servers: self.bootstrap,
            f"http://{readme.http.host}:{readme.http.port}": self.url,
            f'"{readme.kafka.input_topic}"': f'"{self.input_topic}"',
            f'"{readme.kafka.result_topic}"': f'"{self.result_topic}"',
        }
        for old, new in replacements.items():
            code = code.replace(old, new)
        return code


class Stacks:
    """The stacks the blocks run against, each started when a block first needs it, all on one
    broker: the sample model's, and one per model or repository named by a mark."""

    def __init__(self, folder: Path, broker: LocalBroker, sample_model: Path):
        self.folder, self.broker, self.sample_model = folder, broker, sample_model
        self.started: dict[str, Stack] = {}
        self.processes: list[EmbeddedJob | HttpBridge] = []

    def for_block(self, block: Block) -> Stack:
        name = block.marks.get("model", "")
        repository = block.marks.get("repository", "")
        key = f"{name}|{repository}"
        if key not in self.started:
            models = {}
            if repository:
                assert (self.folder / repository).is_dir(), f"no block before this one wrote {repository}/"
                models = {"repository": str(self.folder / repository), "default": block.marks.get("default-model", "")}
            self.started[key] = self._start(self.folder / name if name else self.sample_model, models)
        return self.started[key]

    def _start(self, model: Path, models: dict[str, str]) -> Stack:
        assert model.is_file(), f"no block before this one wrote {model.name}"
        path = write_run_config(
            self.folder, model, self.broker.bootstrap_servers, flink={"checkpoint_interval_ms": 1000}, models=models
        )
        config = load_config(path)
        label = Path(models["repository"]).name if models else model.stem
        job = EmbeddedJob(path, config.flink.rest_port, log_path=self.folder / f"job-{label}.log")
        bridge = HttpBridge(path, log_path=self.folder / f"bridge-{label}.log")
        self.processes += [bridge, job]  # listed first, so that stop() also ends a half-started stack
        job.start()
        bridge.start()
        kafka = config.kafka
        return Stack(kafka.bootstrap_servers, kafka.input_topic, kafka.result_topic, bridge.url)

    def stop(self) -> None:
        for process in self.processes:
            process.stop()


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory, broker: LocalBroker, sample_model: Path) -> Iterator[Stacks]:
    running = Stacks(tmp_path_factory.mktemp("readme"), broker, sample_model)
    try:
        yield running
    finally:
        running.stop()


def test_the_readme_has_python_and_curl_examples() -> None:
    languages = {block.language for block in BLOCKS}
    assert "python" in languages and languages & {"bash", "sh"}, languages
    assert any("expect-error" in block.marks for block in BLOCKS)


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{block.page}-{block.line}-{block.language}" for block in BLOCKS])
def test_readme_block_runs_as_written(block: Block, stacks: Stacks) -> None:
    assert not placeholders(block), f"{block.where} holds a '...' placeholder: {placeholders(block)}"
    code = stacks.for_block(block).rewrite(block.code)
    expected = block.marks.get("expect-error")
    if block.language == "python":
        run_python(block, code, stacks.folder, expected)
    else:
        for command in curl_commands(code):
            run_curl(block, command, expected)


def placeholders(block: Block) -> list[str]:
    """`...` where a value belongs: Python's Ellipsis and strings that hold it (comments may say
    "..." in prose), and any curl argument."""
    if block.language != "python":
        return [arg for command in curl_commands(block.code) for arg in command if "..." in arg]
    tokens = tokenize.generate_tokens(io.StringIO(block.code).readline)
    return [token.string for token in tokens if token.type in (tokenize.OP, tokenize.STRING) and "..." in token.string]


def run_python(block: Block, code: str, folder: Path, expected: str | None) -> None:
    """Runs the block in a fresh namespace; without `expected`, it must raise nothing and leave no
    result that is missing (None) or an error, printed or bound to a name."""
    namespace: dict[str, Any] = {"__name__": "__readme__"}
    printed = io.StringIO()
    raised: Exception | None = None
    try:
        with contextlib.chdir(folder), contextlib.redirect_stdout(printed):
            exec(compile(code, block.where, "exec"), namespace)
    except Exception as exc:  # the block's own failure: what an expect-error block may show
        raised = exc
    finally:
        close_queues(namespace)
    output = printed.getvalue()
    if expected is not None:
        assert expected in f"{output}\n{raised}", f"{block.where} should show {expected!r}; printed {output!r}, raised {raised!r}"
        return
    if raised is not None:
        raise raised
    assert "'error'" not in output, f"{block.where} printed an error result: {output}"
    unserved = {name: value for name, value in namespace.items() if not name.startswith("__") and not served(value)}
    assert not unserved, f"{block.where} left results missing or failed: {unserved}"


def served(value: Any) -> bool:
    """False for a result that never came (None) or came as an error, also inside {uri: result}."""
    if value is None:
        return False
    if isinstance(value, dict):
        return "error" not in value and all(served(item) for item in value.values() if isinstance(item, dict))
    return True


def close_queues(namespace: dict[str, Any]) -> None:
    for value in namespace.values():
        if isinstance(value, (InputQueue, OutputQueue)):
            value.close()


def curl_commands(code: str) -> list[list[str]]:
    """Each command line of a shell block as curl's arguments (comments and continuations read
    as the shell would)."""
    joined = code.replace("\\\n", " ")
    return [args for line in joined.splitlines() if (args := shlex.split(line, comments=True))]


def run_curl(block: Block, args: list[str], expected: str | None) -> None:
    """Runs one curl command; it must answer 200 with JSON that is no error, or, with `expected`,
    another status with an error that says it."""
    assert args[0] == "curl", f"{block.where}: only curl commands run here, not {args[0]}"
    completed = subprocess.run(
        [*args, "--silent", "--show-error", "--write-out", "\n%{http_code}"],
        capture_output=True, text=True, timeout=CURL_TIMEOUT_S, check=False,
    )
    assert completed.returncode == 0, f"{block.where}: curl failed: {completed.stderr}"
    text, _, status = completed.stdout.rpartition("\n")
    body = json.loads(text)
    error = body.get("error") if isinstance(body, dict) else None
    if expected is not None:
        assert status != "200" and error is not None and expected in error, (status, body)
    else:
        assert status == "200" and error is None, f"{block.where}: {shlex.join(args)} -> {status} {text[:500]}"
