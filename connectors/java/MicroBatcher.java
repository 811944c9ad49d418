package clusterserving.flink;

import java.util.ArrayList;
import java.util.List;
import org.apache.flink.api.common.functions.OpenContext;
import org.apache.flink.api.common.state.ListState;
import org.apache.flink.api.common.state.ListStateDescriptor;
import org.apache.flink.api.common.state.ValueState;
import org.apache.flink.api.common.state.ValueStateDescriptor;
import org.apache.flink.api.common.typeinfo.Types;
import org.apache.flink.streaming.api.functions.KeyedProcessFunction;
import org.apache.flink.types.Row;
import org.apache.flink.util.Collector;

/**
 * Groups Row(uri, payload) requests per key and emits one frame (BatchFrames) per micro-batch, at
 * batchSize requests, maxBatchBytes of payload, or maxDelayMs after the first request waiting.
 * Waiting requests live in Flink keyed state, so a checkpoint taken while a batch fills includes
 * them: after a restore they are flushed, never lost with their offsets already committed. Done in
 * the JVM because a Python batcher costs a Python call and a state access per request.
 */
public final class MicroBatcher extends KeyedProcessFunction<Integer, Row, byte[]> {
    private static final long serialVersionUID = 1L;
    private final int batchSize;
    private final long maxDelayMs;
    private final long maxBatchBytes;
    private transient ListState<Row> pending;
    private transient ValueState<Integer> count;
    private transient ValueState<Long> bytes;
    private transient ValueState<Long> deadline;

    public MicroBatcher(int batchSize, long maxDelayMs, long maxBatchBytes) {
        this.batchSize = batchSize;
        this.maxDelayMs = maxDelayMs;
        this.maxBatchBytes = maxBatchBytes;
    }

    @Override
    public void open(OpenContext context) {
        pending = getRuntimeContext().getListState(
            new ListStateDescriptor<>("pending", Types.ROW(Types.STRING, Types.PRIMITIVE_ARRAY(Types.BYTE))));
        count = getRuntimeContext().getState(new ValueStateDescriptor<>("count", Types.INT));
        bytes = getRuntimeContext().getState(new ValueStateDescriptor<>("bytes", Types.LONG));
        deadline = getRuntimeContext().getState(new ValueStateDescriptor<>("deadline", Types.LONG));
    }

    @Override
    public void processElement(Row request, Context ctx, Collector<byte[]> out) throws Exception {
        pending.add(request);
        int waiting = (count.value() == null ? 0 : count.value()) + 1;
        long size = (bytes.value() == null ? 0 : bytes.value()) + BatchFrames.payload(request).length;
        if (waiting >= batchSize || size >= maxBatchBytes || maxDelayMs == 0) {
            flush(ctx, out);
            return;
        }
        count.update(waiting);
        bytes.update(size);
        if (waiting == 1) {
            long due = ctx.timerService().currentProcessingTime() + maxDelayMs;
            ctx.timerService().registerProcessingTimeTimer(due);
            deadline.update(due);
        }
    }

    @Override
    public void onTimer(long timestamp, OnTimerContext ctx, Collector<byte[]> out) throws Exception {
        if (deadline.value() != null && deadline.value() == timestamp) {
            deadline.clear();
            flush(ctx, out);
        }
    }

    private void flush(Context ctx, Collector<byte[]> out) throws Exception {
        List<Row> batch = new ArrayList<>();
        for (Row request : pending.get()) {
            batch.add(request);
        }
        pending.clear();
        count.clear();
        bytes.clear();
        Long due = deadline.value();
        if (due != null) {
            ctx.timerService().deleteProcessingTimeTimer(due);
            deadline.clear();
        }
        if (!batch.isEmpty()) {
            out.collect(BatchFrames.encode(batch));
        }
    }
}
