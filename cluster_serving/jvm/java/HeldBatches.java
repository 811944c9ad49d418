package clusterserving.flink;

import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.atomic.AtomicInteger;
import org.apache.flink.api.common.functions.RuntimeContext;

/**
 * How many batches the Python stage of one task holds (handed to a model's lane, not answered
 * yet), as its last results frame said: SplitResults writes it, the MicroBatchOperator of the same
 * task (chained, on the same thread) reads it to send poll frames while it is not 0. One counter
 * per task attempt, found by the job, the task and its subtask, and the attempt number.
 */
public final class HeldBatches {
    private static final Map<String, AtomicInteger> COUNTS = new ConcurrentHashMap<>();

    private HeldBatches() {}

    public static AtomicInteger of(RuntimeContext context) {
        return COUNTS.computeIfAbsent(key(context), ignored -> new AtomicInteger());
    }

    public static void release(RuntimeContext context) {
        COUNTS.remove(key(context));
    }

    private static String key(RuntimeContext context) {
        return context.getJobInfo().getJobId() + "/" + context.getTaskInfo().getTaskNameWithSubtasks() + "#"
            + context.getTaskInfo().getAttemptNumber();
    }
}
