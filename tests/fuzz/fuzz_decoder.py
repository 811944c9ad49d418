"""Coverage-guided fuzzing (atheris, i.e. libFuzzer) of what the job reads from strangers: the wire
decoder, the image path and the decode stage of a micro-batch. Targets (tests/fuzz/targets.py says
exactly what counts as a bug for each):

    decoder  connectors.codec.decode_message(payload, 1 MiB): raw bytes as they come off Kafka
    message  the same decoder, on Arrow streams built from the input (metadata, column types,
             offsets, nulls, batches, LZ4/ZSTD), to get past the IPC framing more often
    image    cluster_serving.runtime.preprocess.decode_image(name, data, config, 4096) for three ImageConfigs
             (the default; resize + CHW + float32 normalised; grayscale float16)
    batch    cluster_serving.runtime.decode.decode_records(records, limits, preprocess): must never raise

Run one (one process: the machine has other work; `-fork`/`-jobs` would start more):

    pip install -e '.[test]'          # atheris is in the test extra
    python tests/fuzz/make_corpus.py  # (re)writes the seed corpus under tests/fuzz/corpus/
    python -m tests.fuzz.fuzz_decoder -max_total_time=600 tests/fuzz/corpus/decoder
    python -m tests.fuzz.fuzz_decoder --target image -max_total_time=600 tests/fuzz/corpus/image

libFuzzer adds every input that finds new coverage to the FIRST corpus folder it is given; to
keep the repository's seed corpus small, give it a scratch folder first and the seeds second:

    mkdir -p /tmp/fuzz/decoder
    python -m tests.fuzz.fuzz_decoder --target decoder -max_total_time=600 -rss_limit_mb=2048 \
        -artifact_prefix=/tmp/fuzz/ /tmp/fuzz/decoder tests/fuzz/corpus/decoder

(`--target message` starts from tests/fuzz/corpus/message, `--target batch` from
tests/fuzz/corpus/batch.) A bug stops the run with the Python traceback and a `crash-<sha1>` file
(in the current folder, or under -artifact_prefix); replay it with

    python -m tests.fuzz.fuzz_decoder --target image crash-<sha1>

`--skip=UnicodeDecodeError@frombytes,ValueError@_count` lets crashes with those signatures
(exception type @ innermost function; printed once) pass, so that a run goes on to
find other bugs than the ones already reported. `--strict` also reports exceptions that the job's stages catch but that no check raised on
purpose (see tests/fuzz/targets.py). Every other argument is libFuzzer's (-help=1 lists them: -max_len, -timeout, -runs, -dict, ...).
tests/test_fuzz.py replays the seeds and runs each target for a few seconds in CI.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable

import atheris

# The project's modules and Pillow's (pure Python plugins: PNG chunks, JPEG markers, ...) are
# instrumented for coverage; Arrow's C++ reader is not (it is fuzzed upstream with OSS-Fuzz), which
# is what the `message` target makes up for.
INSTRUMENTED = ["cluster_serving", "PIL", "tests.fuzz.targets"]

with atheris.instrument_imports(include=INSTRUMENTED):
    from PIL import Image

    Image.preinit()
    Image.init()  # every plugin Image.open may try, imported now so that it is instrumented
    from tests.fuzz import targets


def split_target(argv: list[str]) -> tuple[str, list[str], set[str]]:
    """Takes `--target NAME` / `--target=NAME`, `--strict` and `--skip=SIG,...` out of argv; the
    rest is libFuzzer's."""
    target, rest, skip, args = "decoder", [argv[0]], set(), iter(argv[1:])
    for arg in args:
        if arg == "--strict":
            targets.STRICT = True
        elif arg.startswith("--skip="):
            skip.update(filter(None, arg.split("=", 1)[1].split(",")))
        elif arg == "--target":
            target = next(args, "")
        elif arg.startswith("--target="):
            target = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    if target not in targets.TARGETS:
        sys.exit(f"unknown target {target!r}: one of {', '.join(targets.TARGETS)}")
    return target, rest, skip


def signature(exc: BaseException) -> str:
    """`ExceptionType@function`, the innermost function it came through (pyarrow's included, so
    that the name survives refactoring of the project's code): `KeyError@get_array_class_from_type`."""
    frames = [frame for frame in traceback.extract_tb(exc.__traceback__)
              if "/tests/fuzz/" not in frame.filename and not frame.name.startswith("<")]
    return f"{type(exc).__name__}@{frames[-1].name.rsplit('.', 1)[-1] if frames else '?'}"


def skipping(check: Callable[[bytes], object], skip: set[str]) -> Callable[[bytes], None]:
    """`check`, printing a crash's signature; one whose signature is in `skip` (a bug already
    reported) is reported once on stderr and then let pass, so that a run looks for other bugs."""
    seen: set[str] = set()

    def run(data: bytes) -> None:
        try:
            check(data)
        except Exception as exc:  # noqa: BLE001 - re-raised unless known
            name = signature(exc)
            if name not in skip:
                print(f"crash signature: {name} (--skip={name} to look past it)", file=sys.stderr, flush=True)
                raise
            if name not in seen:
                seen.add(name)
                print(f"known bug {name} (skipped from now on): {exc!r}; input {data[:64].hex()}...",
                      file=sys.stderr, flush=True)

    return run


def main() -> None:
    target, argv, skip = split_target(sys.argv)
    if target == "batch":
        with atheris.instrument_imports(include=INSTRUMENTED):
            import cluster_serving.runtime.decode  # noqa: F401 - imported here to instrument it
    print(f"fuzz target: {target}{' (strict)' if targets.STRICT else ''}", file=sys.stderr, flush=True)
    check = targets.TARGETS[target]
    atheris.Setup(argv, skipping(check, skip))
    atheris.Fuzz()


if __name__ == "__main__":
    main()
