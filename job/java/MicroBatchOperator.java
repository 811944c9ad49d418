package clusterserving.flink;

import java.util.ArrayList;
import java.util.List;
import org.apache.flink.api.common.operators.ProcessingTimeService.ProcessingTimeCallback;
import org.apache.flink.api.common.state.ListState;
import org.apache.flink.api.common.state.ListStateDescriptor;
import org.apache.flink.api.common.typeinfo.Types;
import org.apache.flink.runtime.state.StateInitializationContext;
import org.apache.flink.runtime.state.StateSnapshotContext;
import org.apache.flink.streaming.api.operators.AbstractStreamOperator;
import org.apache.flink.streaming.api.operators.OneInputStreamOperator;
import org.apache.flink.streaming.runtime.streamrecord.StreamRecord;
import org.apache.flink.types.Row;

/**
 * Groups Row(uri, payload) requests and emits one frame (BatchFrames) per micro-batch, at batchSize
 * requests, maxBatchBytes of payload, or maxDelayMs after the first request waiting.
 *
 * <p>An operator of its own rather than a keyed function, so that it chains to the Kafka source:
 * no network exchange, no per-record serialization, no buffer timeout between them. Waiting
 * requests are operator state, written at every checkpoint, so a checkpoint taken while a batch
 * fills includes them: after a restore (at any parallelism: the lists are redistributed) they are
 * flushed, never lost with their offsets already committed. In the JVM because a Python batcher
 * cost a Python call and a state access per request.
 */
public final class MicroBatchOperator extends AbstractStreamOperator<byte[]>
        implements OneInputStreamOperator<Row, byte[]>, ProcessingTimeCallback {
    private static final long serialVersionUID = 1L;
    private final int batchSize;
    private final long maxDelayMs;
    private final long maxBatchBytes;
    private transient ListState<Row> checkpointed;
    private transient List<Row> pending;
    private transient long pendingBytes;
    private transient long deadline;

    public MicroBatchOperator(int batchSize, long maxDelayMs, long maxBatchBytes) {
        this.batchSize = batchSize;
        this.maxDelayMs = maxDelayMs;
        this.maxBatchBytes = maxBatchBytes;
    }

    @Override
    public void initializeState(StateInitializationContext context) throws Exception {
        super.initializeState(context);
        checkpointed = context.getOperatorStateStore().getListState(
            new ListStateDescriptor<>("pending", Types.ROW(Types.STRING, Types.PRIMITIVE_ARRAY(Types.BYTE))));
        pending = new ArrayList<>();
        pendingBytes = 0;
        deadline = Long.MAX_VALUE;
        for (Row request : checkpointed.get()) {
            pending.add(request);
            pendingBytes += BatchFrames.payload(request).length;
        }
    }

    @Override
    public void open() throws Exception {
        super.open();
        if (!pending.isEmpty()) {
            startWaiting(); // restored requests: flushed within max_delay_ms like any others
        }
    }

    @Override
    public void processElement(StreamRecord<Row> element) {
        Row request = element.getValue();
        pending.add(request);
        pendingBytes += BatchFrames.payload(request).length;
        if (pending.size() >= batchSize || pendingBytes >= maxBatchBytes || maxDelayMs == 0) {
            flush();
        } else if (pending.size() == 1) {
            startWaiting();
        }
    }

    @Override
    public void onProcessingTime(long time) {
        // A timer of a batch flushed early (full) may still fire: it is not this batch's.
        if (time >= deadline && !pending.isEmpty()) {
            flush();
        }
    }

    @Override
    public void snapshotState(StateSnapshotContext context) throws Exception {
        super.snapshotState(context);
        checkpointed.update(pending);
    }

    private void startWaiting() {
        deadline = getProcessingTimeService().getCurrentProcessingTime() + maxDelayMs;
        getProcessingTimeService().registerTimer(deadline, this);
    }

    private void flush() {
        output.collect(new StreamRecord<>(BatchFrames.encode(pending)));
        pending = new ArrayList<>();
        pendingBytes = 0;
        deadline = Long.MAX_VALUE;
    }
}
