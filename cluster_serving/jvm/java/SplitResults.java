package clusterserving.flink;

import org.apache.flink.api.common.functions.FlatMapFunction;
import org.apache.flink.types.Row;
import org.apache.flink.util.Collector;

/** Splits the Python operator's frame of results (BatchFrames) into one Row(key, value, headers) of bytes per result or dead letter. */
public final class SplitResults implements FlatMapFunction<byte[], Row> {
    private static final long serialVersionUID = 1L;

    @Override
    public void flatMap(byte[] frame, Collector<Row> out) {
        for (Row result : BatchFrames.decode(frame)) {
            out.collect(result);
        }
    }
}
