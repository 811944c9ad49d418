package clusterserving.flink;

import java.util.concurrent.atomic.AtomicInteger;
import org.apache.flink.api.common.functions.OpenContext;
import org.apache.flink.api.common.functions.RichFlatMapFunction;
import org.apache.flink.types.Row;
import org.apache.flink.util.Collector;

/**
 * Splits the Python operator's frame of results (BatchFrames) into one Row(key, value, headers) of
 * bytes per result or dead letter, and passes on how many batches Python still holds (HeldBatches).
 */
public final class SplitResults extends RichFlatMapFunction<byte[], Row> {
    private static final long serialVersionUID = 1L;
    private transient AtomicInteger held;

    @Override
    public void open(OpenContext openContext) {
        held = HeldBatches.of(getRuntimeContext());
    }

    @Override
    public void close() {
        HeldBatches.release(getRuntimeContext());
    }

    @Override
    public void flatMap(byte[] frame, Collector<Row> out) {
        held.set(BatchFrames.held(frame));
        for (Row result : BatchFrames.decode(frame)) {
            out.collect(result);
        }
    }
}
