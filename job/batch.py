"""The micro-batcher: groups requests per key and flushes at `batch_size` or `max_delay_ms`.

Waiting requests live in Flink keyed state, not in a Python list, so a checkpoint taken while a
batch is filling includes them: after a restore they are flushed, never lost with the offsets
already committed.
"""

from __future__ import annotations

import zlib
from typing import Iterable

from pyflink.common import Row, Types
from pyflink.datastream import KeyedProcessFunction, KeySelector, RuntimeContext
from pyflink.datastream.state import ListStateDescriptor, ValueStateDescriptor
from pyflink.java_gateway import get_gateway

from conf import BatchingConfig
from connectors.kafka import KEYED_BYTES


# Key groups of the keyed batcher; Flink's own default for parallelism up to 85, set explicitly so
# that subtask_keys() computes with the number the job runs with.
MAX_PARALLELISM = 128


def subtask_keys(parallelism: int, max_parallelism: int = MAX_PARALLELISM) -> list[int]:
    """One key per parallel batcher, the i-th landing on subtask i. Flink places a key by a hash of
    it, so the keys 0..n-1 need not reach n subtasks (with parallelism 2, keys 0 and 1 both went to
    subtask 0 and the second batcher got nothing). Asks Flink's own assignment, through the job's
    Java gateway, which small int lands where; PyFlink keys the stream by a one-field Row holding
    our key (its KeyByKeySelector), so that Row is what gets placed."""
    jvm = get_gateway().jvm
    assign = jvm.org.apache.flink.runtime.state.KeyGroupRangeAssignment.assignKeyToParallelOperator
    first_key_of: dict[int, int] = {}
    key = 0
    while len(first_key_of) < parallelism:
        row = jvm.org.apache.flink.types.Row(1)
        row.setField(0, key)
        first_key_of.setdefault(assign(row, max_parallelism, parallelism), key)
        key += 1
    return [first_key_of[subtask] for subtask in range(parallelism)]


class BatchKey(KeySelector):
    """Spreads requests by uri over `keys`, one key per parallel batcher (see subtask_keys)."""

    def __init__(self, keys: list[int]):
        self.keys = keys

    def get_key(self, value: Row) -> int:
        uri = value[0]
        return self.keys[zlib.crc32(uri.encode()) % len(self.keys) if uri else 0]


class MicroBatcher(KeyedProcessFunction):
    """Emits a list of Row(uri, payload) per flush."""

    def __init__(self, batching: BatchingConfig):
        self.batch_size = batching.batch_size
        self.max_delay_ms = batching.max_delay_ms

    def open(self, runtime_context: RuntimeContext) -> None:
        self.pending = runtime_context.get_list_state(ListStateDescriptor("pending", KEYED_BYTES))
        self.deadline = runtime_context.get_state(ValueStateDescriptor("deadline", Types.LONG()))
        # Mirror of each key's pending count, to avoid reading the list on every element. After a
        # restore the mirror is empty and is rebuilt from state on first use.
        self.counts: dict[int, int] = {}

    def process_element(self, value: Row, ctx: KeyedProcessFunction.Context) -> Iterable[list[Row]]:
        key = ctx.get_current_key()
        count = self._count(key) + 1  # before add(): a rebuilt mirror must not count `value`
        self.pending.add(value)
        self.counts[key] = count
        if count >= self.batch_size or self.max_delay_ms == 0:
            yield self._flush(key, ctx)
        elif count == 1:
            deadline = ctx.timer_service().current_processing_time() + self.max_delay_ms
            ctx.timer_service().register_processing_time_timer(deadline)
            self.deadline.update(deadline)

    def on_timer(self, timestamp: int, ctx: KeyedProcessFunction.OnTimerContext) -> Iterable[list[Row]]:
        key = ctx.get_current_key()
        self.deadline.clear()
        if self._count(key):
            yield self._flush(key, ctx)

    def _count(self, key: int) -> int:
        if key not in self.counts:
            self.counts[key] = sum(1 for _ in self.pending.get() or ())
        return self.counts[key]

    def _flush(self, key: int, ctx: KeyedProcessFunction.Context) -> list[Row]:
        batch = list(self.pending.get())
        self.pending.clear()
        self.counts[key] = 0
        deadline = self.deadline.value()
        if deadline is not None:
            ctx.timer_service().delete_processing_time_timer(deadline)
            self.deadline.clear()
        return batch
