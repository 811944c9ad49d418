package clusterserving.flink;

import org.apache.flink.api.common.functions.OpenContext;
import org.apache.flink.api.common.functions.RichFlatMapFunction;
import org.apache.flink.types.Row;
import org.apache.flink.util.Collector;

/**
 * Splits the Python operator's frame of results (BatchFrames) into one Row(key, value, headers) of
 * bytes per result or dead letter, and passes on which request frames it answers (AnsweredBatches).
 */
public final class SplitResults extends RichFlatMapFunction<byte[], Row> {
    private static final long serialVersionUID = 1L;
    private transient AnsweredBatches answered;

    @Override
    public void open(OpenContext openContext) {
        answered = AnsweredBatches.of(getRuntimeContext());
        answered.attached = true;
    }

    @Override
    public void close() {
        AnsweredBatches.release(getRuntimeContext());
    }

    @Override
    public void flatMap(byte[] frame, Collector<Row> out) {
        if (answered.tracked) {
            for (long number : BatchFrames.answered(frame)) {
                answered.numbers.add(number);
            }
        }
        for (Row result : BatchFrames.decode(frame)) {
            out.collect(result);
        }
    }
}
