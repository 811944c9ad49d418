package clusterserving.flink;

import org.apache.flink.api.java.functions.KeySelector;
import org.apache.flink.runtime.state.KeyGroupRangeAssignment;
import org.apache.flink.types.Row;

/**
 * Spreads requests by uri over one key per parallel batcher. Flink places a key by a hash of it,
 * so the keys 0..n-1 need not reach n subtasks (with parallelism 2, keys 0 and 1 both land on
 * subtask 0); the constructor asks Flink's own assignment which small int lands on which subtask.
 * A model and version can join the key later, batching per model.
 */
public final class UriSlotKey implements KeySelector<Row, Integer> {
    private static final long serialVersionUID = 1L;
    private final int[] keys;

    public UriSlotKey(int parallelism, int maxParallelism) {
        keys = new int[parallelism];
        boolean[] found = new boolean[parallelism];
        int missing = parallelism;
        for (int key = 0; missing > 0; key++) {
            int subtask = KeyGroupRangeAssignment.assignKeyToParallelOperator(key, maxParallelism, parallelism);
            if (!found[subtask]) {
                found[subtask] = true;
                keys[subtask] = key;
                missing--;
            }
        }
    }

    @Override
    public Integer getKey(Row record) {
        String uri = (String) record.getField(0);
        return keys[uri == null ? 0 : Math.floorMod(uri.hashCode(), keys.length)];
    }

    /** The key each subtask batches under, in subtask order. */
    public int[] keys() {
        return keys.clone();
    }
}
