package clusterserving.flink;

import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Collections;
import java.util.Iterator;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Objects;
import java.util.function.BiPredicate;
import org.apache.flink.api.common.operators.MailboxExecutor;
import org.apache.flink.api.common.operators.ProcessingTimeService.ProcessingTimeCallback;
import org.apache.flink.api.common.state.ListState;
import org.apache.flink.api.common.state.ListStateDescriptor;
import org.apache.flink.api.common.state.OperatorStateStore;
import org.apache.flink.api.common.typeinfo.Types;
import org.apache.flink.runtime.state.StateInitializationContext;
import org.apache.flink.runtime.state.StateSnapshotContext;
import org.apache.flink.streaming.api.operators.AbstractStreamOperator;
import org.apache.flink.streaming.api.operators.OneInputStreamOperator;
import org.apache.flink.streaming.runtime.streamrecord.StreamRecord;
import org.apache.flink.streaming.runtime.tasks.mailbox.TaskMailbox;
import org.apache.flink.types.Row;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * Groups Row(uri, payload, model, version, control) requests (KeyValueDeserializationSchema) by
 * their route, the (model, version) their headers name ("" when absent), and emits one frame
 * (BatchFrames) per micro-batch of one route: at the route's batch size, maxBatchBytes of payload,
 * or the route's max delay after its first request waiting. A max delay of 0 waits for no request
 * not yet read: the batch goes once the input has nothing more ready (Triton's dynamic batcher
 * with no queue delay), so a burst already read is one batch, and a lone request goes at once;
 * more than a batch of such a route read back to back goes as one frame (joinsMore), which Python
 * runs batch by batch, the last one partial where the requests do not fill it.
 * Python runs on this operator's thread (a fast model's batches too; a slow one's on threads of
 * its own, see below), so such a model is idle whenever a batch could go: requests that arrive
 * while it runs are read after, and batch together. Batch size and max delay
 * come from the routing table (RoutingTable) entry of the model, the default model's for "" or a
 * model the table does not know (Python answers those with an error result).
 *
 * <p>An operator of its own rather than a keyed function, so that it chains to the Kafka source:
 * no network exchange, no per-record serialization, no buffer timeout between them. Waiting
 * requests are operator state (with their route), written at every checkpoint, so a checkpoint
 * taken while a batch fills includes them: after a restore (at any parallelism: the lists are
 * redistributed) they are flushed, never lost with their offsets already committed. In the JVM
 * because a Python batcher cost a Python call and a state access per request.
 *
 * <p>A control record (the job's repository poller writes one to every partition of the input
 * topic when the repository changes) carries a new table: one with a newer generation flushes
 * every pending batch, each its own frame, under the old table, is adopted, and goes on to Python
 * as a control frame, so that the switch is a position in the Kafka log, the same on a replay. A
 * malformed one is logged once and ignored. The table is
 * operator state too, as union list state: after a restore every subtask takes the newest
 * generation among the restored tables, so that the requests read again after a restore are
 * served by the table they were first read with; the table given to the constructor serves only a
 * job started without state. A job started again with a changed repository gets its new table as
 * a control record its driver writes at start, after the requests it reads again (job/main.py).
 * Control records reach this operator only signed by the driver (KeyValueDeserializationSchema).
 * Python keeps no state, so the first frame after open() is always a control frame with the
 * current table: the Python stages learn the table the restored batches were made by before they
 * meet one.
 *
 * <p>The Python stage may hold batches of slow models on their own threads (runtime/scheduler.py)
 * and answer them with a later frame. Request frames are numbered as they go, and results frames
 * say which they answer (AnsweredBatches): the batches not answered yet are kept here, their
 * requests written at every checkpoint with the pending ones, so that after a restore they are
 * served again rather than lost (Flink's async I/O operator keeps its requests in flight so), and
 * a checkpoint never waits for a slow model. While some are held, a poll frame goes every POLL_MS
 * that no other frame went; at the end of the input a drain frame makes Python answer them all.
 * Should the Python stage not be chained to this operator (nothing answers), every checkpoint
 * barrier waits for a drain frame instead.
 */
public final class MicroBatchOperator extends AbstractStreamOperator<byte[]>
        implements OneInputStreamOperator<Row, byte[]>, ProcessingTimeCallback {
    private static final long serialVersionUID = 1L;
    private static final Logger LOG = LoggerFactory.getLogger(MicroBatchOperator.class);
    // Row(model, version, uri, payload, partition, offset, headers): a new name for each layout, so
    // that the state of an earlier batcher is never read as this one. "pending-routed" held
    // Row(model, version, uri, payload), "pending" (before routes) Row(uri, payload).
    private static final String PENDING_STATE = "pending-sourced";
    private static final String ROUTED_PENDING_STATE = "pending-routed";
    private static final String LEGACY_PENDING_STATE = "pending";
    private static final String TABLE_STATE = "routing-table";
    private static final int URI = 0;
    private static final int PAYLOAD = 1;
    private static final int MODEL = 2;
    private static final int VERSION = 3;
    private static final int CONTROL = 4;
    private static final int PARTITION = 5;
    private static final int OFFSET = 6;
    private static final int HEADERS = 7;
    private static final long MAX_CLOCK_SKEW_MS = 3_600_000;
    private static final long POLL_MS = 1;

    private final String tableText;
    private final long maxBatchBytes;
    private final int maxUriChars;
    private final long maxInstanceBytes;
    private final int maxJoinedBatches;
    private final long maxJoinedBytes;
    private transient RoutingTable table;
    private transient ListState<Row> checkpointed;
    private transient ListState<String> checkpointedTable;
    private transient Map<Route, Batch> pending;
    private transient List<Row> restored;
    private transient MailboxExecutor mailbox;
    private transient long requestsRead;
    private transient boolean idleCheckScheduled;
    private transient AnsweredBatches answered;
    private transient Map<Long, Sent> held;
    private transient long nextNumber;
    private transient boolean pollScheduled;
    private transient long lastFrameAt;

    /**
     * Fails (IllegalArgumentException) on a malformed table: the job's own table must be one.
     * `maxUriChars` and `maxInstanceBytes`: the limits Python checks requests against, which a
     * batch sent as alike requests (BatchFrames) must meet. `maxJoinedBatches` and
     * `maxJoinedBytes`: how many full batches of a route with no delay, and how many bytes of
     * them, may go to Python in one frame (1: each batch its own).
     */
    public MicroBatchOperator(String tableText, long maxBatchBytes, int maxUriChars, long maxInstanceBytes,
                              int maxJoinedBatches, long maxJoinedBytes) {
        RoutingTable.parse(tableText);
        this.tableText = tableText;
        this.maxBatchBytes = maxBatchBytes;
        this.maxUriChars = maxUriChars;
        this.maxInstanceBytes = maxInstanceBytes;
        this.maxJoinedBatches = maxJoinedBatches;
        this.maxJoinedBytes = maxJoinedBytes;
    }

    @Override
    public void initializeState(StateInitializationContext context) throws Exception {
        super.initializeState(context);
        OperatorStateStore store = context.getOperatorStateStore();
        checkpointedTable = store.getUnionListState(new ListStateDescriptor<>(TABLE_STATE, Types.STRING));
        table = null;
        for (String text : checkpointedTable.get()) {
            RoutingTable candidate = parseOrWarn(text, "a restored routing table");
            if (candidate != null && fromTheFuture(candidate)) {
                LOG.warn("ignoring a restored routing table of generation {}: it lies in the future", candidate.generation);
            } else if (candidate != null && (table == null || candidate.generation > table.generation)) {
                table = candidate;
            }
        }
        if (table == null) {
            table = RoutingTable.parse(tableText);
        }
        checkpointed = store.getListState(new ListStateDescriptor<>(PENDING_STATE, Types.ROW(
            Types.STRING, Types.STRING, Types.STRING, Types.PRIMITIVE_ARRAY(Types.BYTE), Types.INT, Types.LONG,
            Types.PRIMITIVE_ARRAY(Types.BYTE))));
        restored = new ArrayList<>();
        for (Row request : checkpointed.get()) {
            restored.add(request);
        }
        if (store.getRegisteredStateNames().contains(ROUTED_PENDING_STATE)) {
            // A checkpoint of the batcher before sources: where its requests came from is not known.
            ListState<Row> routed = store.getListState(new ListStateDescriptor<>(ROUTED_PENDING_STATE,
                Types.ROW(Types.STRING, Types.STRING, Types.STRING, Types.PRIMITIVE_ARRAY(Types.BYTE))));
            for (Row request : routed.get()) {
                restored.add(Row.of(request.getField(0), request.getField(1), request.getField(2), request.getField(3),
                    -1, -1L, null));
            }
            routed.clear();
        }
        if (store.getRegisteredStateNames().contains(LEGACY_PENDING_STATE)) {
            // A checkpoint of the batcher before routes: its requests were all for the one model.
            ListState<Row> legacy = store.getListState(new ListStateDescriptor<>(
                LEGACY_PENDING_STATE, Types.ROW(Types.STRING, Types.PRIMITIVE_ARRAY(Types.BYTE))));
            for (Row request : legacy.get()) {
                restored.add(Row.of("", "", request.getField(0), request.getField(1), -1, -1L, null));
            }
            legacy.clear();
        }
        pending = new LinkedHashMap<>();
    }

    @Override
    public void open() throws Exception {
        super.open();
        mailbox = getContainingTask().getMailboxExecutorFactory().createExecutor(TaskMailbox.MIN_PRIORITY);
        answered = AnsweredBatches.of(getRuntimeContext());
        answered.tracked = answered.attached;
        if (!answered.attached) {
            LOG.warn("the Python stage is not chained to the micro-batcher: every checkpoint waits for the batches it holds");
        }
        held = new LinkedHashMap<>();
        send(BatchFrames.encodeControl(table.text));
        // Restored requests batch like new ones: flushed when full, at their route's max delay, or,
        // with none, once the input has nothing more ready.
        for (Row request : restored) {
            add(new Route((String) request.getField(0), (String) request.getField(1)), Row.of(
                request.getField(2), request.getField(3), request.getField(0), request.getField(1), false,
                request.getField(4), request.getField(5), request.getField(6)));
        }
        restored = null;
    }

    @Override
    public void processElement(StreamRecord<Row> element) {
        Row request = element.getValue();
        if (request.getArity() > CONTROL && Boolean.TRUE.equals(request.getField(CONTROL))) {
            control((byte[]) request.getField(PAYLOAD));
        } else {
            requestsRead++;
            add(new Route(text(request, MODEL), text(request, VERSION)), request);
        }
    }

    @Override
    public void onProcessingTime(long time) {
        // A timer of a batch flushed early (full, or by a control record) may still fire: the
        // batch of its route now, if any, has a later deadline.
        flushWhere((route, batch) -> batch.deadline <= time);
    }

    /** The end of a bounded input (or stop --drain): what waits goes out now. */
    @Override
    public void finish() throws Exception {
        flushAll();
        send(BatchFrames.encodeSignal('D'));
        super.finish();
    }

    /** Unchained (no numbers come back), the barrier waits until Python has answered every batch. */
    @Override
    public void prepareSnapshotPreBarrier(long checkpointId) throws Exception {
        super.prepareSnapshotPreBarrier(checkpointId);
        if (!answered.attached) {
            send(BatchFrames.encodeSignal('D'));
        }
    }

    @Override
    public void close() throws Exception {
        AnsweredBatches.release(getRuntimeContext());
        super.close();
    }

    @Override
    public void snapshotState(StateSnapshotContext context) throws Exception {
        super.snapshotState(context);
        List<Row> requests = new ArrayList<>();
        for (Sent batch : held.values()) {
            addRows(requests, batch.route, batch.requests);
        }
        for (Map.Entry<Route, Batch> batch : pending.entrySet()) {
            addRows(requests, batch.getKey(), batch.getValue().requests);
        }
        checkpointed.update(requests);
        checkpointedTable.update(Collections.singletonList(table.text));
    }

    private static void addRows(List<Row> state, Route route, List<Row> requests) {
        for (Row request : requests) {
            state.add(Row.of(route.model, route.version, request.getField(URI), request.getField(PAYLOAD),
                orElse(BatchFrames.field(request, PARTITION), -1), orElse(BatchFrames.field(request, OFFSET), -1L),
                BatchFrames.field(request, HEADERS)));
        }
    }

    private void add(Route route, Row request) {
        Batch batch = pending.get(route);
        if (batch == null) {
            batch = new Batch();
            pending.put(route, batch);
        }
        batch.requests.add(request);
        batch.bytes += BatchFrames.payload(request).length;
        RoutingTable.Entry entry = table.entryFor(route.model);
        int size = batch.requests.size();
        if (batch.bytes >= maxBatchBytes || size >= entry.batchSize && !joinsMore(entry, batch)) {
            emit(route, batch);
            pending.remove(route);
        } else if (entry.maxDelayMs == 0) {
            scheduleIdleCheck();
        } else if (batch.requests.size() == 1) {
            batch.deadline = getProcessingTimeService().getCurrentProcessingTime() + entry.maxDelayMs;
            getProcessingTimeService().registerTimer(batch.deadline, this);
        }
    }

    /**
     * Whether a route with no delay whose batch is full waits, with the input still ready, for more
     * requests to go to Python in the same frame: up to maxJoinedBatches full batches and
     * maxJoinedBytes, so that only small requests ride together and a frame of large ones is one batch.
     */
    private boolean joinsMore(RoutingTable.Entry entry, Batch batch) {
        return entry.maxDelayMs == 0 && batch.requests.size() < entry.batchSize * maxJoinedBatches
            && batch.bytes < maxJoinedBytes;
    }

    /**
     * Finds out, through the task's mailbox, when the input has nothing more ready. A mail posted
     * while a record is processed runs before the next record is read, so it posts the check,
     * which runs after the next read, or at once when there was nothing to read: if no request was
     * read in between, the batches of routes with no delay go; if one was, it looks again after
     * the next read, for as long as such a batch waits.
     */
    private void scheduleIdleCheck() {
        if (!idleCheckScheduled) {
            idleCheckScheduled = true;
            mailbox.execute(this::checkAfterNextRead, "micro-batch: wait for the next read");
        }
    }

    private void checkAfterNextRead() {
        long read = requestsRead;
        mailbox.execute(() -> flushIfIdle(read), "micro-batch: flush if the input is idle");
    }

    private void flushIfIdle(long read) {
        if (requestsRead != read) {
            checkAfterNextRead();
            return;
        }
        idleCheckScheduled = false;
        flushWhere((route, batch) -> table.entryFor(route.model).maxDelayMs == 0);
    }

    private void control(byte[] value) {
        String text = value == null ? "" : new String(value, StandardCharsets.UTF_8);
        RoutingTable next = parseOrWarn(text, "a control record of the input topic");
        if (next == null) {
            return;
        }
        if (next.generation <= table.generation && !fromTheFuture(table)) {
            // Every partition carries the marker: a subtask reading several meets it more than once.
            LOG.debug("routing table generation {} is not newer than {}: ignored", next.generation, table.generation);
            return;
        }
        flushAll();
        table = next;
        LOG.info("routing table generation {}: default model {}, models {}", table.generation, table.defaultModel,
            table.entries.keySet());
        send(BatchFrames.encodeControl(table.text));
    }

    private void flushAll() {
        flushWhere((route, batch) -> true);
    }

    /** Emits the pending batches that are `due`, in the order their routes first waited. */
    private void flushWhere(BiPredicate<Route, Batch> due) {
        Iterator<Map.Entry<Route, Batch>> batches = pending.entrySet().iterator();
        while (batches.hasNext()) {
            Map.Entry<Route, Batch> batch = batches.next();
            if (due.test(batch.getKey(), batch.getValue())) {
                emit(batch.getKey(), batch.getValue());
                batches.remove();
            }
        }
    }

    /** Sends a route's batch as BatchFrames.encodeRoute frames it. */
    private void emit(Route route, Batch batch) {
        int batchSize = table.entryFor(route.model).batchSize;
        for (BatchFrames.Part part : BatchFrames.encodeRoute(
                route.model, route.version, batch.requests, batchSize, maxUriChars, maxInstanceBytes)) {
            sendBatch(route, part.requests, part.frame);
        }
    }

    private void sendBatch(Route route, List<Row> requests, byte[] frame) {
        if (answered.attached) {
            held.put(nextNumber, new Sent(route, requests));
        }
        nextNumber++;
        send(frame);
    }

    /**
     * Hands Python a frame (it runs on this thread, and so does SplitResults after it), forgets
     * the batches it answered, and polls later if it holds some still.
     */
    private void send(byte[] frame) {
        output.collect(new StreamRecord<>(frame));
        Long number;
        while ((number = answered.numbers.poll()) != null) {
            held.remove(number);
        }
        lastFrameAt = getProcessingTimeService().getCurrentProcessingTime();
        if (!held.isEmpty() && !pollScheduled) {
            pollScheduled = true;
            getProcessingTimeService().registerTimer(lastFrameAt + POLL_MS, this::poll);
        }
    }

    private void poll(long time) {
        pollScheduled = false;
        if (held.isEmpty()) {
            return;
        }
        if (time < lastFrameAt + POLL_MS) {
            pollScheduled = true;
            getProcessingTimeService().registerTimer(lastFrameAt + POLL_MS, this::poll);
            return;
        }
        send(BatchFrames.encodeSignal('P'));
    }

    /**
     * Whether a table's generation (its driver's clock in milliseconds) lies further ahead than
     * clocks disagree: such a table never blocks the next one, so that a table forged before
     * control records were signed and kept in a checkpoint cannot lock later tables out.
     */
    private static boolean fromTheFuture(RoutingTable candidate) {
        return candidate.generation > System.currentTimeMillis() + MAX_CLOCK_SKEW_MS;
    }

    private static RoutingTable parseOrWarn(String text, String what) {
        try {
            return RoutingTable.parse(text);
        } catch (IllegalArgumentException e) {
            LOG.warn("ignoring {}: not a routing table ({})", what, e.getMessage());
            return null;
        }
    }

    private static Object orElse(Object value, Object otherwise) {
        return value == null ? otherwise : value;
    }

    private static String text(Row request, int field) {
        Object value = request.getArity() > field ? request.getField(field) : null;
        return value == null ? "" : (String) value;
    }

    /** A batch's key: the model and version as the request's headers said ("" when absent). */
    private static final class Route {
        final String model;
        final String version;

        Route(String model, String version) {
            this.model = model == null ? "" : model;
            this.version = version == null ? "" : version;
        }

        @Override
        public boolean equals(Object other) {
            return other instanceof Route && model.equals(((Route) other).model)
                && version.equals(((Route) other).version);
        }

        @Override
        public int hashCode() {
            return Objects.hash(model, version);
        }
    }

    /** A batch sent to Python and not answered yet: its route and requests. */
    private static final class Sent {
        final Route route;
        final List<Row> requests;

        Sent(Route route, List<Row> requests) {
            this.route = route;
            this.requests = requests;
        }
    }

    /** The requests waiting for one route, their payload bytes, and when they are due. */
    private static final class Batch {
        final List<Row> requests = new ArrayList<>();
        long bytes;
        long deadline = Long.MAX_VALUE;
    }
}
