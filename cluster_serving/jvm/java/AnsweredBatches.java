package clusterserving.flink;

import java.util.ArrayDeque;
import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;
import org.apache.flink.api.common.functions.RuntimeContext;

/**
 * The numbers of the request frames the Python stage of one task has answered, as its results
 * frames say: SplitResults adds them, the MicroBatchOperator of the same task (chained to it, on
 * the same thread) takes them after each frame it sends, to know which batches Python holds still.
 * One per task attempt, found by the job, the task and its subtask, and the attempt number;
 * `attached` says that a SplitResults of this task opened (it opens before the batcher), `tracked`
 * that a batcher of this task takes the numbers (else SplitResults keeps none).
 */
public final class AnsweredBatches {
    private static final Map<String, AnsweredBatches> BY_TASK = new ConcurrentHashMap<>();

    final ArrayDeque<Long> numbers = new ArrayDeque<>();
    boolean attached;
    boolean tracked;

    private AnsweredBatches() {}

    public static AnsweredBatches of(RuntimeContext context) {
        return BY_TASK.computeIfAbsent(key(context), ignored -> new AnsweredBatches());
    }

    public static void release(RuntimeContext context) {
        BY_TASK.remove(key(context));
    }

    private static String key(RuntimeContext context) {
        return context.getJobInfo().getJobId() + "/" + context.getTaskInfo().getTaskNameWithSubtasks() + "#"
            + context.getTaskInfo().getAttemptNumber();
    }
}
