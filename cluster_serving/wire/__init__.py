"""The wire format of requests and results: one message per Kafka record, in one of two versions.
`connectors.codec` picks the version and is the entry point; this package holds the parts.

Version 2 (`v2.py`), written for messages of dense numeric tensors and encoded images (the
common cases, and the fast one): `CST2`, uint16 uri length, the uri (UTF-8), uint32 layout length,
the layout (UTF-8 JSON: {"tensors": [[name, dtype, shape], ...]} and, for results, "batch_size"
and "inference_us"), then each tensor's values, little-endian, C order, back to back in layout
order; an image is ["name", "image", []] and its values a uint32 length and the file's bytes.
Decoding is a header read and a numpy view per tensor; a batch of results shares one layout,
written once.

Version 1 (`v1.py`), for everything else (strings, sparse tensors, errors, top-N results; images
as earlier writers wrote them), and read for all: one Arrow IPC stream (docs/wire-format.md has the full description):
- schema metadata `cs.version` = "1", `cs.uri` = the request's uri, and for results optionally
  `cs.error` (the error message; no tensors then) with `cs.error_code` (values.ERROR_CODES),
  `cs.batch_size` (the batch it ran in),
  `cs.inference_us` (that batch's inference time in microseconds) and `cs.top_n` (the result is
  the N best classes: tensors `classes` and `probabilities`);
- one column per named value, exactly one row, field metadata `cs.dtype` and `cs.shape`, laid
  out by the value's kind (`kinds.py`):
  - dense tensor: large_list<T>, the values flattened in C order; `cs.dtype` a numpy dtype name
    (or "str"), `cs.shape` a JSON list of ints;
  - sparse tensor (`cs.layout` = "coo"): struct<indices: large_list<int64>, values: large_list<T>>,
    one row of `rank` indices per value; `cs.shape` is the dense shape;
  - encoded image (`cs.dtype` = "image"): large_list<large_binary> holding the JPEG/PNG bytes,
    decoded by the job; `cs.shape` = "[]".

Arrow is a maintained, language-neutral format with a fuzzed reader; numeric tensors are written
and read without copying. Nothing here builds arbitrary objects: dtypes come from an allow-list
and every shape is checked against its payload.
"""
