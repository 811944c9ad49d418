package clusterserving.flink;

import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.util.Set;
import javax.crypto.Mac;
import javax.crypto.spec.SecretKeySpec;
import org.apache.flink.api.common.serialization.DeserializationSchema;
import org.apache.flink.api.common.typeinfo.TypeInformation;
import org.apache.flink.api.common.typeinfo.Types;
import org.apache.flink.connector.kafka.source.reader.deserializer.KafkaRecordDeserializationSchema;
import org.apache.flink.metrics.Counter;
import org.apache.flink.types.Row;
import org.apache.flink.util.Collector;
// The connector jar carries kafka-clients relocated under org.apache.flink.kafka.shaded.
import org.apache.flink.kafka.shaded.org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.flink.kafka.shaded.org.apache.kafka.common.header.Header;
import org.apache.flink.kafka.shaded.org.apache.kafka.common.header.Headers;
import org.apache.flink.kafka.shaded.org.apache.kafka.common.header.internals.RecordHeaders;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * Emits Row(uri, payload, model, version, control, partition, offset, headers) for every Kafka
 * record: the key as a UTF-8 string or null, so the job knows a request's uri even when the value
 * cannot be decoded; the value bytes; the `model` and `version` headers as UTF-8 strings (null
 * when absent or empty; MLServer's `mlserver-model` and `mlserver-version` where they are); control true for a record with a `cluster-serving-control` header, whose
 * value is a routing table (RoutingTable) rather than a request; where the record was read (for
 * its dead letter); its other headers as a HeaderBlock (null when none: the deadline, say, or a
 * producer's own). job/batch.py's REQUEST_ROW is the same type.
 *
 * <p>Anyone who may write requests may write that header, so a control record is passed on only
 * when its `cluster-serving-signature` header is the HMAC-SHA256 of its value under the job's key
 * (cluster_serving/job/control_key.py). Any other is dropped here, counted in the metric
 * `forgedControlRecords` and logged (the first, then at every power of two), never routed.
 *
 * <p>A replay (`replaying`) serves a range of the log again with a table of its own: it drops
 * every control record, and may route every request to one model and version instead of its
 * headers'.
 */
public final class KeyValueDeserializationSchema implements KafkaRecordDeserializationSchema<Row> {
    private static final long serialVersionUID = 1L;
    private static final Logger LOG = LoggerFactory.getLogger(KeyValueDeserializationSchema.class);
    public static final String MODEL_HEADER = "model";
    public static final String VERSION_HEADER = "version";
    // Seldon MLServer's Kafka headers: they route a request that has no `model` / `version` header.
    public static final String MLSERVER_MODEL_HEADER = "mlserver-model";
    public static final String MLSERVER_VERSION_HEADER = "mlserver-version";
    // An OIP request's timeout parameter counts from its record's timestamp: the JVM passes it on
    // to Python as this header, for records that claim an OIP encoding only.
    public static final String SELDON_TYPE_HEADER = "seldon-infer-type";
    public static final String TIMESTAMP_HEADER = "cluster-serving-record-timestamp";
    public static final String CONTROL_HEADER = "cluster-serving-control";
    public static final String SIGNATURE_HEADER = "cluster-serving-signature";
    private static final String HMAC = "HmacSHA256";
    private static final String[] FIELDS = {"uri", "payload", "model", "version", "control", "partition", "offset", "headers"};
    private static final Set<String> ROUTE_HEADERS = Set.of(MODEL_HEADER, VERSION_HEADER);

    private final byte[] controlKey;
    // A replay's: no control key (control records dropped) and the route it may force.
    private final boolean replay;
    private final String routeModel;
    private final String routeVersion;
    private transient Mac mac;
    private transient Counter forged;
    private transient long forgedSeen;

    /** `controlKeyHex`: the key that signs the job's routing tables, in hex. */
    public KeyValueDeserializationSchema(String controlKeyHex) {
        if (controlKeyHex == null || controlKeyHex.length() < 32 || controlKeyHex.length() % 2 != 0) {
            throw new IllegalArgumentException("the control key must be an even number of hex digits, at least 32");
        }
        controlKey = new byte[controlKeyHex.length() / 2];
        for (int i = 0; i < controlKey.length; i++) {
            controlKey[i] = (byte) Integer.parseInt(controlKeyHex.substring(2 * i, 2 * i + 2), 16);
        }
        replay = false;
        routeModel = null;
        routeVersion = null;
    }

    private KeyValueDeserializationSchema(String model, String version) {
        controlKey = new byte[0];
        replay = true;
        routeModel = model;
        routeVersion = version;
    }

    /** A replay's schema: control records dropped; with a `model`, every request routed to it and `version` (null: its newest). */
    public static KeyValueDeserializationSchema replaying(String model, String version) {
        return new KeyValueDeserializationSchema(model, version);
    }

    @Override
    public void open(DeserializationSchema.InitializationContext context) throws Exception {
        if (!replay) {
            mac = Mac.getInstance(HMAC);
            mac.init(new SecretKeySpec(controlKey, HMAC));
        }
        forged = context.getMetricGroup().counter("forgedControlRecords");
    }

    @Override
    public void deserialize(ConsumerRecord<byte[], byte[]> record, Collector<Row> out) {
        byte[] key = record.key();
        String uri = key == null ? null : new String(key, StandardCharsets.UTF_8);
        boolean control = record.headers().lastHeader(CONTROL_HEADER) != null;
        if (control && replay) {
            return;
        }
        if (control && !signed(record)) {
            dropForged(record);
            return;
        }
        boolean routed = routeModel != null;
        out.collect(Row.of(
            uri, record.value(), routed ? routeModel : header(record, MODEL_HEADER, MLSERVER_MODEL_HEADER),
            routed ? routeVersion : header(record, VERSION_HEADER, MLSERVER_VERSION_HEADER), control,
            record.partition(), record.offset(), control ? null : HeaderBlock.encode(passedOn(record), ROUTE_HEADERS)));
    }

    /** The record's headers, with its timestamp added for one in an OIP encoding. */
    private static Headers passedOn(ConsumerRecord<byte[], byte[]> record) {
        Headers headers = record.headers();
        if (headers.lastHeader(SELDON_TYPE_HEADER) == null && headers.lastHeader(MLSERVER_MODEL_HEADER) == null) {
            return headers;
        }
        RecordHeaders timed = new RecordHeaders(headers.toArray());
        timed.add(TIMESTAMP_HEADER, Long.toString(record.timestamp()).getBytes(StandardCharsets.US_ASCII));
        return timed;
    }

    private boolean signed(ConsumerRecord<byte[], byte[]> record) {
        Header signature = record.headers().lastHeader(SIGNATURE_HEADER);
        if (signature == null || signature.value() == null) {
            return false;
        }
        byte[] value = record.value() == null ? new byte[0] : record.value();
        byte[] expected = hex(mac.doFinal(value)).getBytes(StandardCharsets.US_ASCII);
        return MessageDigest.isEqual(expected, signature.value());
    }

    private void dropForged(ConsumerRecord<byte[], byte[]> record) {
        forged.inc();
        forgedSeen++;
        if (Long.bitCount(forgedSeen) == 1) {
            LOG.warn("dropped a control record without a valid signature (topic {} partition {} offset {}): only"
                + " the job's repository poller changes what is served; {} dropped so far",
                record.topic(), record.partition(), record.offset(), forgedSeen);
        }
    }

    /** The last value of header `name`, else of `alias`, as UTF-8 text; null when both are absent or empty. */
    private static String header(ConsumerRecord<byte[], byte[]> record, String name, String alias) {
        String value = header(record, name);
        return value != null ? value : header(record, alias);
    }

    private static String header(ConsumerRecord<byte[], byte[]> record, String name) {
        Header header = record.headers().lastHeader(name);
        byte[] value = header == null ? null : header.value();
        return value == null || value.length == 0 ? null : new String(value, StandardCharsets.UTF_8);
    }

    private static String hex(byte[] bytes) {
        StringBuilder text = new StringBuilder(bytes.length * 2);
        for (byte b : bytes) {
            text.append(Character.forDigit((b >> 4) & 0xf, 16)).append(Character.forDigit(b & 0xf, 16));
        }
        return text.toString();
    }

    @Override
    public TypeInformation<Row> getProducedType() {
        return Types.ROW_NAMED(
            FIELDS, Types.STRING, Types.PRIMITIVE_ARRAY(Types.BYTE), Types.STRING, Types.STRING, Types.BOOLEAN,
            Types.INT, Types.LONG, Types.PRIMITIVE_ARRAY(Types.BYTE));
    }
}
